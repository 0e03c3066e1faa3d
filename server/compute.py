"""Measured compute speed of hosted blocks: one token through one block, measured once per setup and cached."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from swarm.model import BlockRange, cache_root

log = logging.getLogger(__name__)


def _cache_key(blocks: BlockRange, model_id: str) -> str:
    device = blocks.device.type
    if device == "cuda":
        device = torch.cuda.get_device_name(blocks.device)
    config_digest = hashlib.sha256(blocks.config.to_json_string(use_diff=False).encode()).hexdigest()[:12]
    cpu = platform.processor() or platform.machine()
    parts = [model_id, config_digest, blocks.dtype_name, blocks.quant, device, cpu,
             f"threads={torch.get_num_threads()}", f"torch={torch.__version__}"]
    return "|".join(parts)


def measure_block_compute_ms(blocks: BlockRange, *, repeats: int = 10) -> float:
    """Gives the fastest of `repeats` decode steps (one token, short history) through one block, in ms.

    The minimum, not the median: other processes starting at the same time only ever inflate a sample.
    """
    caches = blocks.new_caches(blocks.start, blocks.start + 1, batch=1, capacity=repeats + 2)
    hidden = torch.randn(1, 1, blocks.hidden_size, generator=torch.Generator().manual_seed(0))
    blocks(hidden, caches, 0)  # warm-up: first calls pay for allocation and kernel selection
    samples = []
    for position in range(1, repeats + 1):
        started = time.perf_counter()
        blocks(hidden, caches, position)
        if blocks.device.type == "cuda":
            torch.cuda.synchronize(blocks.device)
        samples.append((time.perf_counter() - started) * 1000)
    return min(samples)


def cached_block_compute_ms(blocks: BlockRange, model_id: str, *, path: Path | None = None) -> float:
    """Gives the measured per-block compute time, measuring only when this setup has no cached value."""
    path = path or cache_root() / "block_compute_ms.json"
    key = _cache_key(blocks, model_id)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(key), int | float):
        return float(cached[key])
    value = measure_block_compute_ms(blocks)
    cached[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.{os.getpid()}")
    staging.write_text(json.dumps(cached, indent=1, sort_keys=True))
    staging.replace(path)
    log.info("Measured %.2f ms per block per token (%s)", value, key)
    return value
