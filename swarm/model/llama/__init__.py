"""Llama family (Llama 2/3, SmolLM2, TinyLlama): transformers' own Llama block classes."""

from __future__ import annotations

from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from swarm.model.family import DecoderFamily, register_family

LLAMA = register_family(
    DecoderFamily(
        name="llama",
        model_types=("llama",),
        decoder_layer=LlamaDecoderLayer,
        rotary_embedding=LlamaRotaryEmbedding,
        rms_norm=LlamaRMSNorm,
    )
)
