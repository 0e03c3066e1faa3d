"""Llama family (Llama 2/3, SmolLM2, TinyLlama): transformers' own Llama block classes are its reference."""

from __future__ import annotations

from swarm.model.family import DecoderFamily, register_family

LLAMA = register_family(
    DecoderFamily(
        name="llama",
        model_types=("llama",),
        reference="transformers.models.llama.modeling_llama",
        classes="Llama",
    )
)
