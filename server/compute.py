"""Measured compute speed of hosted blocks: a decode step through one block at batch 1, 8 and 32, and a prefill
chunk's time per token at the start of a sequence and after `LONG_HISTORY_TOKENS` of history (attention grows with
the history), measured at every start and kept per setup as the fastest figures measured so far."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

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
LOCK_WAIT_S = 30.0  # bounds how long a start waits for another process of the machine to finish measuring


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


@contextlib.contextmanager
def _measuring_alone(path: Path, wait_s: float) -> Iterator[bool]:
    """Holds the machine's measuring lock (a `flock` beside the cache) while the block is measured and the cache
    rewritten, so that servers starting together measure one after another instead of slowing each other's samples,
    and none loses another's entry. Gives whether it got the lock: after `wait_s` (a holder that hangs, e.g. a
    stopped process) it measures without it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "a") as handle:
        deadline = time.monotonic() + wait_s
        while not (locked := _try_lock(handle)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not locked:
            log.warning("Another process has held %s for %.0f s: measuring without it", handle.name, wait_s)
        try:
            yield locked
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _try_lock(handle: IO[str]) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _faster(cached: BlockSpeed | None, measured: BlockSpeed) -> BlockSpeed:
    """Gives each figure at its fastest of the two: a process computing beside a measurement only ever slows it."""
    if cached is None:
        return measured
    long = [ms for ms in (cached.prefill_ms_per_token_long, measured.prefill_ms_per_token_long) if ms is not None]
    return BlockSpeed(
        {batch: min(ms, cached.decode_ms.get(batch, ms)) for batch, ms in measured.decode_ms.items()},
        min(cached.prefill_ms_per_token, measured.prefill_ms_per_token),
        min(long) if long else None,
    )


def cached_block_speed(
    blocks: BlockRange, model_id: str, *, path: Path | None = None, lock_wait_s: float = LOCK_WAIT_S
) -> BlockSpeed:
    """Gives the per-block speed of this setup: measured now (about 0.3 s for a SmolLM2 block on a CPU), one process
    of the machine at a time, and merged with the cache of earlier starts figure by figure, keeping the faster.

    A measurement under load (servers of one machine loading their weights while another measures) can read 2-4x
    slow in every sample, and a cache that kept the first one announced that for good: the orchestrator's chain
    speeds, the migration mode's prefill budget and the simulators fitted to the records all read it. Taking the
    fastest of every start corrects such a figure at the next one."""
    path = path or cache_root() / "block_compute_ms.json"
    key = _cache_key(blocks, model_id)
    with _measuring_alone(path, lock_wait_s):
        measured = measure_block_speed(blocks)
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
        entry = cached.get(key)
        names = (*map(str, DECODE_BATCHES), "prefill_per_token", "prefill_per_token_long")
        before = None
        if isinstance(entry, dict) and all(isinstance(entry.get(name), int | float) for name in names):
            before = BlockSpeed({batch: float(entry[str(batch)]) for batch in DECODE_BATCHES},
                                float(entry["prefill_per_token"]), float(entry["prefill_per_token_long"]))
        speed = _faster(before, measured)
        cached[key] = {**{str(batch): ms for batch, ms in speed.decode_ms.items()},
                       "prefill_per_token": speed.prefill_ms_per_token,
                       "prefill_per_token_long": speed.prefill_ms_per_token_long}
        staging = path.with_name(f"{path.name}.{os.getpid()}")
        staging.write_text(json.dumps(cached, indent=1, sort_keys=True))
        staging.replace(path)
    log.info("Measured a block: %s, prefill %.3f ms per token (%.3f after %d tokens); announcing %s, prefill %.3f "
             "ms per token, the fastest measured (%s)",
             ", ".join(f"{ms:.2f} ms at batch {batch}" for batch, ms in measured.decode_ms.items()),
             measured.prefill_ms_per_token, measured.prefill_ms_per_token_long, LONG_HISTORY_TOKENS,
             ", ".join(f"{ms:.2f} ms at batch {batch}" for batch, ms in speed.decode_ms.items()),
             speed.prefill_ms_per_token, key)
    return speed
