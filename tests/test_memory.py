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
    assert pool.allocate(KVOwner("s1", block=0), 2) == (4, 5)
    assert pool.stats() == PoolStats(
        pages_total=10, pages_params=4, pages_kv=2, pages_free=4, page_bytes=KIB, free_runs=(4,)
    )
    assert pool.owner_of(5) == KVOwner("s1", block=0)
    assert pool.owner_of(6) is None

    assert pool.free(ParamsOwner(block=0)) == 4
    assert pool.free(ParamsOwner(block=0)) == 0
    # An owner holds one contiguous run, from the lowest run that fits: freed parameter pages are reused first.
    assert pool.allocate(KVOwner("s2", block=0), 3) == (0, 1, 2)
    assert pool.allocate(KVOwner("s3", block=0), 2) == (6, 7)
    assert pool.pages_of(KVOwner("s2", block=0)) == (0, 1, 2)
    assert pool.stats().pages_kv == 7
    pool.check_invariants()


def test_fragmented_pages_are_refused_until_neighbours_free_and_runs_merge() -> None:
    pool = PagePool(total_bytes=10 * KIB, page_bytes=KIB)
    for name, pages in (("a", 3), ("b", 2), ("c", 3), ("d", 2)):
        pool.allocate(KVOwner(name, block=0), pages)
    pool.free_session("b")
    pool.free_session("d")
    assert pool.stats().pages_free == 4
    assert pool.stats().free_runs == (2, 2)  # what a server announces, so clients route around it
    with pytest.raises(OutOfPages, match="4 of 10 are free, and no 3 of them are contiguous"):
        pool.allocate(KVOwner("e", block=0), 3)
    pool.free_session("c")  # frees 5..7 between the runs 3..4 and 8..9: one run of 7
    assert pool.allocate(KVOwner("e", block=0), 7) == tuple(range(3, 10))
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
            if pool.pages_of(owner):
                continue
            try:
                pages = pool.allocate(owner, rng.randint(1, 12))
            except OutOfPages:
                out_of_pages_count += 1
            else:
                assert all(pool.owner_of(page) == owner for page in pages)
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
