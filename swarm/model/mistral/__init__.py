"""Mistral family: Llama layout plus an optional sliding attention window."""

from __future__ import annotations

from transformers import PretrainedConfig

from swarm.model.family import DecoderFamily, register_family


def _sliding_window(config: PretrainedConfig, index: int) -> int | None:
    return getattr(config, "sliding_window", None)


MISTRAL = register_family(
    DecoderFamily(
        name="mistral",
        model_types=("mistral",),
        reference="transformers.models.mistral.modeling_mistral",
        classes="Mistral",
        sliding_window=_sliding_window,
    )
)
