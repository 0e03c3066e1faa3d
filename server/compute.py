"""Measured compute speed of hosted blocks: a decode step through one block at batch 1, 8 and 32, and a prefill
chunk's time per token at the start of a sequence and after `LONG_HISTORY_TOKENS` of history (attention grows with
the history), measured once per setup and cached."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.memory import PagePool
from swarm.model import BlockRange, cache_root
from swarm.model.paged_kv import PagedBatch, PagedKV, SequenceChunk
from swarm.records import LONG_PREFILL_HISTORY_TOKENS as LONG_HISTORY_TOKENS

log = logging.getLogger(__name__)

DECODE_BATCHES = (1, 8, 32)
HISTORY_TOKENS = 16  # each measured sequence attends over this much history
PREFILL_CHUNK_TOKENS = 128  # a prompt chunk as the scheduler cuts them by default (--max-batch-tokens)
ENGINE = "paged-v1"  # bump when the block implementation changes what a measurement means


def _cache_key(blocks: BlockRange, model_id: str) -> str:
    device = blocks.device.type
    if device == "cuda":
        device = torch.cuda.get_device_name(blocks.device)
    config_digest = hashlib.sha256(blocks.config.to_json_string(use_diff=False).encode()).hexdigest()[:12]
    cpu = platform.processor() or platform.machine()
    parts = [model_id, config_digest, blocks.dtype_name, blocks.quant, device, cpu,
             f"threads={torch.get_num_threads()}", f"torch={torch.__version__}", ENGINE]
    return "|".join(parts)


@dataclass(frozen=True)
class BlockSpeed:
    """One block's measured speed: a decode step by batch size, and a prefill chunk's time per prompt token (ms),
    at the start of a sequence and after LONG_HISTORY_TOKENS of history (None: not measured)."""

    decode_ms: dict[int, float]
    prefill_ms_per_token: float
    prefill_ms_per_token_long: float | None = None


def measure_block_speed(
    blocks: BlockRange, *, batches: tuple[int, ...] = DECODE_BATCHES, chunk_tokens: int = PREFILL_CHUNK_TOKENS,
    repeats: int = 7,
) -> BlockSpeed:
    """Gives, per batch size, the fastest of `repeats` decode steps (one token per session, short history) through
    one block, and the fastest prefill of a `chunk_tokens` chunk per token, at the start of a sequence and after
    LONG_HISTORY_TOKENS of history, in ms. The minimum, not the median:
    other processes starting at the same time only ever inflate a sample."""
    index = blocks.start
    tokens_per_page = max(HISTORY_TOKENS + 2, chunk_tokens)
    page_bytes = tokens_per_page * blocks.kv_bytes_per_token()
    pool = PagePool(max(batches) * page_bytes, page_bytes, device=blocks.device)
    kv = blocks.paged_kv(pool.storage, page_bytes)
    generator = torch.Generator().manual_seed(0)

    def fastest(hidden: torch.Tensor, batch: PagedBatch, paged: PagedKV = kv) -> float:
        blocks(hidden, batch, paged)  # warm-up: first calls pay for allocation and kernel selection
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            blocks(hidden, batch, paged)
            if blocks.device.type == "cuda":
                torch.cuda.synchronize(blocks.device)
            samples.append((time.perf_counter() - started) * 1000)
        return min(samples)

    chunk = PagedBatch((SequenceChunk(0, chunk_tokens, 0, index, index + 1, {index: [0]}),))
    prefill_ms = fastest(torch.randn(chunk_tokens, blocks.hidden_size, generator=generator), chunk)
    long_page_bytes = (LONG_HISTORY_TOKENS + chunk_tokens) * blocks.kv_bytes_per_token()
    long_kv = blocks.paged_kv(PagePool(long_page_bytes, long_page_bytes, device=blocks.device).storage, long_page_bytes)
    long_chunk = PagedBatch((SequenceChunk(0, chunk_tokens, LONG_HISTORY_TOKENS, index, index + 1, {index: [0]}),))
    # the history's keys and values are the pool's zeros: attention costs the same whatever they hold
    long_ms = fastest(torch.randn(chunk_tokens, blocks.hidden_size, generator=generator), long_chunk, long_kv)
    timings: dict[int, float] = {}
    for batch in batches:
        prefill = PagedBatch(tuple(
            SequenceChunk(row * HISTORY_TOKENS, HISTORY_TOKENS, 0, index, index + 1, {index: [row]})
            for row in range(batch)
        ))
        blocks(torch.randn(batch * HISTORY_TOKENS, blocks.hidden_size, generator=generator), prefill, kv)
        decode = PagedBatch(tuple(
            SequenceChunk(row, 1, HISTORY_TOKENS, index, index + 1, {index: [row]}) for row in range(batch)
        ))
        timings[batch] = fastest(torch.randn(batch, blocks.hidden_size, generator=generator), decode)
    return BlockSpeed(timings, prefill_ms / chunk_tokens, long_ms / chunk_tokens)


def cached_block_speed(blocks: BlockRange, model_id: str, *, path: Path | None = None) -> BlockSpeed:
    """Gives the measured per-block speed, measuring only when this setup has none cached."""
    path = path or cache_root() / "block_compute_ms.json"
    key = _cache_key(blocks, model_id)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key)
    names = (*map(str, DECODE_BATCHES), "prefill_per_token", "prefill_per_token_long")
    if isinstance(entry, dict) and all(isinstance(entry.get(name), int | float) for name in names):
        return BlockSpeed({batch: float(entry[str(batch)]) for batch in DECODE_BATCHES},
                          float(entry["prefill_per_token"]), float(entry["prefill_per_token_long"]))
    speed = measure_block_speed(blocks)
    cached[key] = {**{str(batch): ms for batch, ms in speed.decode_ms.items()},
                   "prefill_per_token": speed.prefill_ms_per_token,
                   "prefill_per_token_long": speed.prefill_ms_per_token_long}
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.{os.getpid()}")
    staging.write_text(json.dumps(cached, indent=1, sort_keys=True))
    staging.replace(path)
    log.info("Measured a block: %s, prefill %.3f ms per token (%.3f after %d tokens) (%s)",
             ", ".join(f"{ms:.2f} ms at batch {batch}" for batch, ms in speed.decode_ms.items()),
             speed.prefill_ms_per_token, speed.prefill_ms_per_token_long, LONG_HISTORY_TOKENS, key)
    return speed
