"""Qwen2 family: Llama layout with q/k/v biases and per-layer sliding attention when enabled."""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

from swarm.model.family import DecoderFamily, register_family


def _sliding_window(config: PretrainedConfig, index: int) -> int | None:
    layer_types = getattr(config, "layer_types", None) or []
    if index < len(layer_types) and layer_types[index] == "sliding_attention":
        return config.sliding_window
    return None


QWEN2 = register_family(
    DecoderFamily(
        name="qwen2",
        model_types=("qwen2",),
        decoder_layer=Qwen2DecoderLayer,
        rotary_embedding=Qwen2RotaryEmbedding,
        rms_norm=Qwen2RMSNorm,
        sliding_window=_sliding_window,
    )
)
