"""Load block ranges of Hugging Face checkpoints and the client-side head; one adapter folder per family."""

from __future__ import annotations

from swarm.model import llama, mistral, qwen2  # noqa: F401  (each registers its family)
from swarm.model.blocks import BlockRange, parse_block_range
from swarm.model.device import DTYPES, dtype_name, pick_device, pick_dtype
from swarm.model.family import DecoderFamily, get_family, supported_model_types
from swarm.model.head import ClientHead
from swarm.model.paged_kv import PagedBatch, PagedKV, SequenceChunk
from swarm.model.quant import QUANT_MODES
from swarm.model.source import DEFAULT_MODEL, ModelNotFound, ModelSource, cache_root, resolve_model

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "QUANT_MODES",
    "BlockRange",
    "ClientHead",
    "DecoderFamily",
    "ModelNotFound",
    "ModelSource",
    "PagedBatch",
    "PagedKV",
    "SequenceChunk",
    "cache_root",
    "dtype_name",
    "get_family",
    "parse_block_range",
    "pick_device",
    "pick_dtype",
    "resolve_model",
    "supported_model_types",
]
