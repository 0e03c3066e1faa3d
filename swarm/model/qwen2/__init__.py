"""Qwen2 family: Llama layout with q/k/v biases and per-layer sliding attention when enabled."""

from __future__ import annotations

from transformers import PretrainedConfig

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
        reference="transformers.models.qwen2.modeling_qwen2",
        classes="Qwen2",
        sliding_window=_sliding_window,
    )
)
