"""The slot pool: size parsing, page accounting, all-or-nothing allocation and invariants under churn."""

from __future__ import annotations

import random

import pytest
import torch

from swarm.errors import OutOfPages
from swarm.memory import (
    DEFAULT_PAGE_BYTES,
    KVOwner,
    PagePool,
    ParamsOwner,
    PoolStats,
    default_budget_bytes,
    packed_bytes,
    parse_size,
)

KIB = 1024


@pytest.mark.parametrize(
    ("text", "expected_bytes"),
    [
        ("4096", 4096),
        ("2GB", 2_000_000_000),
        ("512MB", 512_000_000),
        ("1.5GiB", 1536 * 1024**2),
        ("64KiB", 64 * 1024),
        ("64kib", 64 * 1024),
        (" 3 mib ", 3 * 1024**2),
        ("10B", 10),
        ("1TB", 10**12),
        ("0", 0),
    ],
)
def test_parse_size_accepts_decimal_and_binary_units(text: str, expected_bytes: int) -> None:
    assert parse_size(text) == expected_bytes


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "2 gigabytes", "1.5", "0.1KiB", "1e9", "2G", "1,5GB", "nan"])
def test_parse_size_rejects_garbage_with_a_clear_message(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_default_budget_on_cpu_is_positive() -> None:
    assert default_budget_bytes(torch.device("cpu")) > 0


def test_pages_needed_rounds_up() -> None:
    pool = PagePool(total_bytes=10 * KIB, page_bytes=KIB)
    assert pool.pages_total == 10
    assert [pool.pages_needed(nbytes) for nbytes in (0, 1, KIB, KIB + 1, 3 * KIB)] == [0, 1, 1, 2, 3]
    assert PagePool(total_bytes=DEFAULT_PAGE_BYTES * 3 + 5).pages_total == 3


def test_allocate_and_free_keep_accounting_straight() -> None:
    pool = PagePool(total_bytes=10 * KIB, page_bytes=KIB)
    assert pool.allocate(ParamsOwner(block=0), 4) == (0, 1, 2, 3)
    assert pool.take(KVOwner("s1", block=0), 2) == (9, 8)  # KV pages come from the top, runs from the bottom
    assert pool.stats() == PoolStats(pages_total=10, pages_params=4, pages_kv=2, pages_free=4, page_bytes=KIB)
    assert pool.owner_of(8) == KVOwner("s1", block=0)
    assert pool.owner_of(6) is None

    assert pool.free(ParamsOwner(block=0)) == 4
    assert pool.free(ParamsOwner(block=0)) == 0
    assert pool.allocate(ParamsOwner(block=1), 3) == (0, 1, 2)  # the lowest run that fits
    assert pool.take(KVOwner("s1", block=0), 1) == (7,)  # a session grows page by page
    assert pool.pages_of(KVOwner("s1", block=0)) == (9, 8, 7)
    assert pool.stats().pages_kv == 3
    pool.check_invariants()


def test_kv_pages_need_no_contiguous_run_and_freed_pages_merge_back_into_runs() -> None:
    pool = PagePool(total_bytes=10 * KIB, page_bytes=KIB)
    pool.allocate(ParamsOwner(block=0), 2)
    for name in "abcd":  # interleaved growth: every session's pages are scattered
        for _ in range(2):
            pool.take(KVOwner(name, block=0), 1)
    assert pool.stats().pages_free == 0
    with pytest.raises(OutOfPages, match="needs 1 more page"):
        pool.take(KVOwner("e", block=0), 1)
    pool.free_session("b")
    pool.free_session("d")
    assert pool.take(KVOwner("e", block=0), 4)  # four scattered free pages serve one sequence
    pool.free_session("e")
    pool.free_session("a")
    pool.free_session("c")
    assert pool.allocate(ParamsOwner(block=1), 8) == tuple(range(2, 10))  # the pages merged into one run again
    pool.check_invariants()


def test_parameters_need_a_contiguous_run() -> None:
    pool = PagePool(total_bytes=10 * KIB, page_bytes=KIB)
    for block in range(5):
        pool.allocate(ParamsOwner(block), 2)
    pool.free(ParamsOwner(1))
    pool.free(ParamsOwner(3))
    with pytest.raises(OutOfPages, match="4 of 10 are free, and no 3 of them are contiguous"):
        pool.allocate(ParamsOwner(9), 3)
    pool.take(KVOwner("s", 0), 2)
    with pytest.raises(ValueError, match="one run"):  # KV pages have no single buffer: they are read page by page
        pool.buffer(KVOwner("s", 0))
    pool.check_invariants()


def test_adopted_tensors_live_in_pool_memory_and_keep_their_values() -> None:
    pool = PagePool(total_bytes=64 * KIB, page_bytes=4 * KIB)
    layer = torch.nn.Linear(30, 20)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    inputs = torch.randn(3, 30)
    expected = layer(inputs)
    pages = pool.adopt(ParamsOwner(block=7), [layer.weight, layer.bias])
    assert pages == (0,)  # 30*20*4 + 20*4 bytes, the bias aligned after the weight: one 4 KiB page
    assert packed_bytes([layer.weight, layer.bias]) == 2432 + 80  # the bias starts at 2400 rounded up to 64
    torch.testing.assert_close(layer(inputs), expected, rtol=0, atol=0)
    assert torch.equal(layer.weight, weight) and torch.equal(layer.bias, bias)
    run = pool.buffer(ParamsOwner(block=7))
    start = pool.storage.data_ptr()
    assert start <= layer.weight.data_ptr() < layer.bias.data_ptr() < start + pool.page_bytes
    assert layer.bias.data_ptr() % 64 == 0
    run.zero_()  # the module's tensors are views of the owner's pages: writing the pages changes them
    assert not layer.weight.any() and not layer.bias.any()
    assert isinstance(layer.weight, torch.nn.Parameter)


def test_one_allocation_per_owner() -> None:
    pool = PagePool(total_bytes=10 * KIB, page_bytes=KIB)
    pool.allocate(ParamsOwner(block=1), 1)
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate(ParamsOwner(block=1), 1)
    with pytest.raises(ValueError, match="positive"):
        pool.allocate(ParamsOwner(block=2), 0)


def test_out_of_pages_leaves_the_pool_unchanged() -> None:
    pool = PagePool(total_bytes=8 * KIB, page_bytes=KIB)
    pool.allocate(ParamsOwner(block=0), 5)
    before_stats, before_owners = pool.stats(), pool.owners()
    with pytest.raises(OutOfPages, match=r"needs 4 pages .* only 3 of 8 are free$"):
        pool.allocate(KVOwner("s1", block=0), 4)
    with pytest.raises(OutOfPages, match="needs 4 more page"):
        pool.take(KVOwner("s1", block=0), 4)
    assert pool.stats() == before_stats
    assert pool.owners() == before_owners
    assert pool.pages_of(KVOwner("s1", block=0)) == ()
    pool.check_invariants()


def test_free_session_frees_only_that_session() -> None:
    pool = PagePool(total_bytes=20 * KIB, page_bytes=KIB)
    pool.allocate(ParamsOwner(block=0), 2)
    for block in range(3):
        pool.allocate(KVOwner("keep", block), 1)
        pool.allocate(KVOwner("drop", block), 2)
    assert pool.free_session("drop") == 6
    assert pool.free_session("drop") == 0
    assert set(pool.owners()) == {ParamsOwner(0), KVOwner("keep", 0), KVOwner("keep", 1), KVOwner("keep", 2)}
    assert pool.stats().pages_free == 20 - 2 - 3
    pool.check_invariants()


def test_invariants_hold_after_random_operations() -> None:
    rng = random.Random(1234)
    pool = PagePool(total_bytes=64 * KIB, page_bytes=KIB)
    sessions = [f"session-{index}" for index in range(6)]
    out_of_pages_count = 0
    for _ in range(4000):
        owner = ParamsOwner(rng.randrange(4)) if rng.random() < 0.3 else KVOwner(rng.choice(sessions), rng.randrange(4))
        action = rng.random()
        if action < 0.5:
            held = pool.pages_of(owner)
            if held and isinstance(owner, ParamsOwner):
                continue
            try:
                if isinstance(owner, ParamsOwner):
                    pages = pool.allocate(owner, rng.randint(1, 12))
                else:
                    pages = pool.take(owner, rng.randint(1, 4))
            except OutOfPages:
                out_of_pages_count += 1
            else:
                assert all(pool.owner_of(page) == owner for page in pages)
                assert pool.pages_of(owner) == held + pages
        elif action < 0.85:
            held = len(pool.pages_of(owner))
            assert pool.free(owner) == held
        else:
            session_id = rng.choice(sessions)
            held = sum(len(pages) for o, pages in pool.owners().items() if getattr(o, "session_id", None) == session_id)
            assert pool.free_session(session_id) == held
        pool.check_invariants()
        stats = pool.stats()
        assert stats.pages_params + stats.pages_kv + stats.pages_free == stats.pages_total
    assert out_of_pages_count > 0, "the sequence should have exercised a full pool"
