"""Mistral family: Llama layout plus an optional sliding attention window."""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.models.mistral.modeling_mistral import (
    MistralDecoderLayer,
    MistralRMSNorm,
    MistralRotaryEmbedding,
)

from swarm.model.family import DecoderFamily, register_family


def _sliding_window(config: PretrainedConfig, index: int) -> int | None:
    return getattr(config, "sliding_window", None)


MISTRAL = register_family(
    DecoderFamily(
        name="mistral",
        model_types=("mistral",),
        decoder_layer=MistralDecoderLayer,
        rotary_embedding=MistralRotaryEmbedding,
        rms_norm=MistralRMSNorm,
        sliding_window=_sliding_window,
    )
)
