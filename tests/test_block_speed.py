"""A server's measured block speed: measured at every start, one process of the machine at a time, and kept per
setup as the fastest figures measured so far, so that a start that measured under load is corrected by the next."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest

from server.compute import DECODE_BATCHES, _cache_key, cached_block_speed
from swarm.model import BlockRange, resolve_model

MODEL_ID = "tiny-llama"


@pytest.fixture(scope="module")
def block(tiny_llama: Path) -> BlockRange:
    return BlockRange(resolve_model(str(tiny_llama)), 0, 1)


def cached_entry(path: Path, block: BlockRange) -> dict[str, float]:
    return json.loads(path.read_text())[_cache_key(block, MODEL_ID)]


def write_entry(path: Path, block: BlockRange, ms: float) -> None:
    entry = {**{str(batch): ms for batch in DECODE_BATCHES}, "prefill_per_token": ms, "prefill_per_token_long": ms}
    path.write_text(json.dumps({_cache_key(block, MODEL_ID): entry, "another setup": {"1": 7.0}}))


def test_a_figure_measured_slow_under_load_is_replaced_by_the_next_starts_faster_one(
    block: BlockRange, tmp_path: Path
) -> None:
    cache = tmp_path / "block_compute_ms.json"
    write_entry(cache, block, 1000.0)  # a first start that measured while the machine was busy
    speed = cached_block_speed(block, MODEL_ID, path=cache)
    assert all(ms < 1000.0 for ms in speed.decode_ms.values())
    assert speed.prefill_ms_per_token < 1000.0 and speed.prefill_ms_per_token_long < 1000.0
    entry = cached_entry(cache, block)
    assert entry == {**{str(batch): ms for batch, ms in speed.decode_ms.items()},
                     "prefill_per_token": speed.prefill_ms_per_token,
                     "prefill_per_token_long": speed.prefill_ms_per_token_long}
    assert json.loads(cache.read_text())["another setup"] == {"1": 7.0}  # other setups' entries stay


def test_a_start_that_measures_slower_than_before_keeps_the_faster_figures(block: BlockRange, tmp_path: Path) -> None:
    cache = tmp_path / "block_compute_ms.json"
    write_entry(cache, block, 1e-6)  # faster than any measurement: the new one only ever loses to it
    speed = cached_block_speed(block, MODEL_ID, path=cache)
    assert set(speed.decode_ms) == set(DECODE_BATCHES)
    assert all(ms == 1e-6 for ms in speed.decode_ms.values())
    assert speed.prefill_ms_per_token == speed.prefill_ms_per_token_long == 1e-6


def test_a_start_measures_even_when_another_process_holds_the_measuring_lock_too_long(
    block: BlockRange, tmp_path: Path
) -> None:
    cache = tmp_path / "block_compute_ms.json"
    with open(tmp_path / "block_compute_ms.json.lock", "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # e.g. a server stopped while it measured
        speed = cached_block_speed(block, MODEL_ID, path=cache, lock_wait_s=0.2)
    assert cached_entry(cache, block)["prefill_per_token"] == speed.prefill_ms_per_token > 0
