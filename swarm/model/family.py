"""Model families: one small adapter per architecture, registered by `model_type`, never an `if` in generic code."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from swarm.errors import UnsupportedArchitecture


@dataclass(frozen=True)
class DecoderFamily:
    """What distinguishes one decoder-only family whose checkpoints use the `model.layers.{i}` layout.

    Llama, Mistral and Qwen2 share this layout, and the server runs all of them with one block implementation
    (`swarm.model.decoder`); what differs is data: the rotary embedding (its scaling), whether a block attends over
    a sliding window, and the biases a checkpoint carries. `reference` names transformers' modelling module and
    `classes` its prefix there: its decoder layer is the reference the server's block is tested against, imported
    only when asked for (a server's start-up need not pay for transformers' modelling code).
    """

    name: str
    model_types: tuple[str, ...]
    reference: str  # e.g. "transformers.models.llama.modeling_llama"
    classes: str  # e.g. "Llama": LlamaDecoderLayer, LlamaRotaryEmbedding, LlamaRMSNorm
    sliding_window: Callable[[PretrainedConfig, int], int | None] = lambda config, index: None
    layer_prefix: str = "model.layers.{index}."
    embed_key: str = "model.embed_tokens.weight"
    norm_key: str = "model.norm.weight"
    lm_head_key: str = "lm_head.weight"

    @property
    def decoder_layer(self) -> type[nn.Module]:
        return self._reference_class("DecoderLayer")

    @property
    def rotary_embedding(self) -> type[nn.Module]:
        return self._reference_class("RotaryEmbedding")

    @property
    def rms_norm(self) -> type[nn.Module]:
        return self._reference_class("RMSNorm")

    def _reference_class(self, suffix: str) -> type[nn.Module]:
        return getattr(importlib.import_module(self.reference), self.classes + suffix)

    def block_prefix(self, index: int) -> str:
        """Gives the checkpoint key prefix of block `index`."""
        return self.layer_prefix.format(index=index)

    def kv_shape(self, config: PretrainedConfig) -> tuple[int, int]:
        """Gives (kv_heads, head_dim) of one block's attention cache."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return config.num_key_value_heads, head_dim


_FAMILIES: dict[str, DecoderFamily] = {}


def register_family(family: DecoderFamily) -> DecoderFamily:
    """Makes `family` available to `get_family` for each of its model types."""
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def get_family(config: PretrainedConfig) -> DecoderFamily:
    """Gives the adapter for `config.model_type`, or raises UnsupportedArchitecture naming the supported ones."""
    model_type = getattr(config, "model_type", None)
    family = _FAMILIES.get(str(model_type))
    if family is None:
        supported = ", ".join(sorted(_FAMILIES))
        raise UnsupportedArchitecture(f"model_type {model_type!r} is not supported (supported: {supported})")
    return family


def supported_model_types() -> list[str]:
    """Gives the model types that have an adapter."""
    return sorted(_FAMILIES)
