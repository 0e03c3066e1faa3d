"""Emulated GPU servers, for experiments with many GPU servers on one machine (`swarm-server --emulate-gpu`).

A CPU cannot play nine GPUs. An emulated server computes the real tensors of its blocks (a tiny model, so that costs
little) and holds each batch, block by block, until the profile's time for the blocks done has passed (so steps
still join a batch between two blocks, as on the real engine, and pay for the blocks they catch up through); its
pool is the profile's memory in the reference model's geometry, scaled down to the served model. Never the default;
its record says it is emulated.

Profile: per block of the reference model (LLaMA-2-7B, fp16: 0.404 GB of parameters, 16 KiB of KV per token),
- `prefill_ms_per_token`: the compute of one token through one block (a prompt token, or a decode row's);
- `decode_ms_base` + `decode_ms_per_row` x rows: the memory traffic of a step of `rows` sessions of `ROW_TOKENS`
  (2048) tokens of history through one block: the parameters once, and each row's own KV (a row of h tokens costs
  `decode_ms_per_row` x h / 2048);
- `memory_gb`: what the GPU (slice) holds for parameters and KV.
A batch through a block takes the longer of its memory traffic and its compute (the roofline): decode steps are
bound by memory, so a prefill chunk that rides in their batch costs little until its compute outgrows their
traffic, which is what chunked prefill (Sarathi-Serve, vLLM) counts on; a long chunk alone is bound by compute.
Scaling: k = (served model's KV bytes per token per block) / (reference's). The pool gets k x memory_gb, and each
loaded block holds at least k x the reference block's bytes in pages (its real tensors fill the first pages). So
in pages, a server holds as many blocks and as many KV tokens as the profile's GPU holds of the reference model.

The built-in profiles are A100 MIG slices, from their share of an A100's compute (312 dense fp16 TFLOPS) and memory
bandwidth (1555 GB/s): 3g.40gb has 3/7 of the compute and 4/8 of the bandwidth, 2g.20gb 2/7 and 2/8. A decode
step streams the block's parameters (0.404 GB) at half the slice's bandwidth and each row's KV (its history x
16 KiB) besides, plus 0.1 ms of kernel launches; a prefill token costs the block's 0.81 GFLOP at 40% of the
slice's compute.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from swarm.model.paged_kv import PagedBatch

REFERENCE_BLOCK_BYTES = 404_000_000  # LLaMA-2-7B: 6.74e9 parameters less embeddings, over 32 blocks, fp16
REFERENCE_KV_BYTES_PER_TOKEN = 2 * 32 * 128 * 2  # keys and values, 32 heads x 128, fp16
ROW_TOKENS = 2048  # the history of a row in `decode_ms_per_row` and in the decode times a record announces


@dataclass(frozen=True)
class GpuProfile:
    """Per-block times and the memory of one emulated GPU, for the reference model."""

    name: str
    memory_gb: float
    prefill_ms_per_token: float
    decode_ms_base: float
    decode_ms_per_row: float

    def __post_init__(self) -> None:
        if not (self.memory_gb > 0 and self.prefill_ms_per_token >= 0 and self.decode_ms_base >= 0
                and self.decode_ms_per_row >= 0):
            raise ValueError(f"invalid GPU profile {self}")

    def decode_ms(self, rows: int, history_tokens: int = ROW_TOKENS) -> float:
        """Gives a decode step of `rows` sessions of `history_tokens` tokens each through one block."""
        traffic = self.decode_ms_base + self.decode_ms_per_row * rows * history_tokens / ROW_TOKENS
        return max(traffic, rows * self.prefill_ms_per_token)

    def chunk_ms_per_token(self, tokens: int) -> float:
        """Gives a prefill chunk of `tokens` tokens alone through one block, per token (what a server measures)."""
        return max(self.decode_ms_base, tokens * self.prefill_ms_per_token) / tokens

    def block_ms(self, batch: PagedBatch, block: int) -> float:
        """Gives the time the profile's GPU takes for `batch` through `block`: the longer of its memory traffic (the
        parameters once, each decode row's own history of KV) and its compute (every token of the batch); chunks
        that do not pass through `block` cost nothing."""
        through = [chunk for chunk in batch.chunks if chunk.block_start <= block < chunk.block_end]
        if not through:
            return 0.0
        history = sum(chunk.position + 1 for chunk in through if chunk.tokens == 1)
        traffic = self.decode_ms_base + self.decode_ms_per_row * history / ROW_TOKENS
        return max(traffic, sum(chunk.tokens for chunk in through) * self.prefill_ms_per_token)

    def batch_ms(self, batch: PagedBatch) -> float:
        """Gives the time the profile's GPU takes for `batch` through all its blocks."""
        first = min(chunk.block_start for chunk in batch.chunks)
        end = max(chunk.block_end for chunk in batch.chunks)
        return sum(self.block_ms(batch, block) for block in range(first, end))

    def scale(self, kv_bytes_per_token: int) -> float:
        """Gives k: the served model's KV per token over the reference's."""
        return kv_bytes_per_token / REFERENCE_KV_BYTES_PER_TOKEN

    def pool_bytes(self, kv_bytes_per_token: int) -> int:
        """Gives the pool budget of the served model: the profile's memory, scaled."""
        return int(self.memory_gb * 1e9 * self.scale(kv_bytes_per_token))

    def block_bytes(self, kv_bytes_per_token: int) -> int:
        """Gives the bytes a loaded block holds at least: the reference block, scaled."""
        return math.ceil(REFERENCE_BLOCK_BYTES * self.scale(kv_bytes_per_token))


def _slice(name: str, memory_gb: float, compute_sevenths: int, bandwidth_eighths: int) -> GpuProfile:
    tflops, bandwidth_gb_per_ms = 312.0 * compute_sevenths / 7, 1.555 * bandwidth_eighths / 8
    kv_row_gb = 2048 * REFERENCE_KV_BYTES_PER_TOKEN / 1e9
    return GpuProfile(
        name=name, memory_gb=memory_gb,
        prefill_ms_per_token=2 * REFERENCE_BLOCK_BYTES / 2 / (0.4 * tflops * 1e9),  # 2 FLOP per fp16 parameter
        decode_ms_base=0.1 + REFERENCE_BLOCK_BYTES / 1e9 / (0.5 * bandwidth_gb_per_ms),
        decode_ms_per_row=kv_row_gb / (0.5 * bandwidth_gb_per_ms),
    )


PROFILES: dict[str, GpuProfile] = {
    profile.name: profile for profile in (_slice("a100-3g.40gb", 40.0, 3, 4), _slice("a100-2g.20gb", 20.0, 2, 2))
}


def load_profile(name_or_path: str) -> GpuProfile:
    """Gives a built-in profile by name, or one from a JSON file with the fields of `GpuProfile`."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown GPU profile {name_or_path!r}: use one of {', '.join(PROFILES)} or a JSON file")
    try:
        fields = json.loads(path.read_text())
        return GpuProfile(**{"name": path.stem, **fields})
    except (ValueError, TypeError) as error:
        fields_wanted = ", ".join(asdict(PROFILES["a100-2g.20gb"]))
        raise ValueError(f"GPU profile {path}: {error} (fields: {fields_wanted})") from None
