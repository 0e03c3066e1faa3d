"""The KV-packing simulator: deterministic, never over capacity, every session departs, batching never adds
migrations, moves take their time and hold both sides, and a packer out of bins rejects or evicts, never crashes."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest

from orchestrator.packing import (
    Allocate,
    BestFitPacker,
    Depart,
    Item,
    LoadBalancePacker,
    MellPacker,
    MigrationCosts,
    Move,
    Operation,
    Packer,
    Update,
    WorstFitPacker,
    batch_operations,
)
from orchestrator.sim.packing_sim import PackingSimConfig, SessionSpec, simulate
from orchestrator.sim.packing_sim_moves import MigrationQueue
from orchestrator.sim.packing_sim_workload import class_histogram, scaled_lengths

BINS = [f"gpu{i:02d}" for i in range(60)]
PACKERS: dict[str, Callable[[int], Packer]] = {
    "mell": lambda capacity: MellPacker(BINS, capacity),
    "bf": lambda capacity: BestFitPacker(BINS, capacity),
    "wf": lambda capacity: WorstFitPacker(BINS, capacity),
    "lb": lambda capacity: LoadBalancePacker(BINS, capacity),
}


def config(**changes) -> PackingSimConfig:
    base = dict(
        capacity_pages=64,
        tokens_per_page=16,
        kv_bytes_per_token=1000,
        decode_tokens_per_s=20.0,
        bandwidth_bytes_per_s=2e6,
        rtt_ms=5.0,
        prefill_ms_per_token=0.5,
    )
    return PackingSimConfig(**(base | changes))


def random_sessions(seed: int, count: int = 120, max_tokens: int = 1024) -> list[SessionSpec]:
    rng = random.Random(seed)
    sessions, now = [], 0.0
    for index in range(count):
        now += rng.expovariate(1.5)
        prompt = rng.choice([rng.randint(1, 60), rng.randint(1, max_tokens // 2)])
        output = rng.randint(1, max(1, min(400, max_tokens - prompt)))
        sessions.append(SessionSpec(f"s{index:03d}", round(now, 3), prompt, output))
    return sessions


@pytest.mark.parametrize("kind", sorted(PACKERS))
def test_same_sessions_give_the_same_run(kind):
    sessions = random_sessions(1)
    runs = [simulate(sessions, PACKERS[kind](64), config()) for _ in range(2)]
    assert runs[0].summary == runs[1].summary and runs[0].epochs == runs[1].epochs
    assert runs[0].departed_s == runs[1].departed_s


@pytest.mark.parametrize("kind", sorted(PACKERS))
@pytest.mark.parametrize("batching", [True, False])
def test_no_bin_exceeds_its_capacity_and_every_session_departs_when_done(kind, batching):
    sessions = random_sessions(2)
    cfg = config(batching=batching, check_invariants=True)
    result = simulate(sessions, PACKERS[kind](64), cfg)
    summary = result.summary
    assert summary.max_packed_load_pages <= 64
    assert summary.rejected == summary.evicted == 0
    assert set(result.departed_s) == {s.session_id for s in sessions} and summary.completed == len(sessions)
    for session in sessions:  # admitted at the next boundary, done after ceil(output / 20) epochs
        admitted = -(-session.arrival_s // 1.0)
        assert result.departed_s[session.session_id] == admitted + max(1, -(-session.output_tokens // 20))
    assert all(record.packed_pages <= record.pages_held for record in result.epochs)
    assert summary.peak_bins_lower_bound <= summary.peak_packed_bins <= summary.peak_active_bins
    assert summary.migrations == summary.kv_migrations + summary.replay_migrations


@pytest.mark.parametrize("kind", ["mell", "lb"])
@pytest.mark.parametrize("seed", [3, 4, 5])
def test_batching_never_increases_migrations(kind, seed):
    sessions = random_sessions(seed)
    batched = simulate(sessions, PACKERS[kind](64), config(epoch_s=3.0)).summary
    one_by_one = simulate(sessions, PACKERS[kind](64), config(epoch_s=3.0, batching=False)).summary
    # within an epoch batching only removes moves; across epochs the runs part (exchanges leave other sessions on
    # each bin), so one by one is a separate run of the same sessions
    assert batched.planned_moves <= batched.unbatched_moves
    assert batched.migrations < one_by_one.migrations


class EpochRecorder:
    """Delegates to a packer and records its operations, cut into epochs where the simulator reads `active_bins`
    (once before the run, then once per epoch, after the epoch's operations)."""

    def __init__(self, packer: Packer) -> None:
        self._packer = packer
        self.name = packer.name
        self.calls: list[Operation] = []
        self.epochs: list[list[Operation]] = []

    def __getattr__(self, name: str):
        return getattr(self._packer, name)

    def allocate(self, item: Item) -> list[Move]:
        self.calls.append(Allocate(item))
        return self._packer.allocate(item)

    def depart(self, item_id: str) -> list[Move]:
        self.calls.append(Depart(item_id))
        return self._packer.depart(item_id)

    def update(self, item_id: str, new_pages: int) -> list[Move]:
        self.calls.append(Update(item_id, new_pages))
        return self._packer.update(item_id, new_pages)

    def active_bins(self) -> tuple[str, ...]:
        self.epochs.append(self.calls)
        self.calls = []
        return self._packer.active_bins()


@pytest.mark.parametrize("kind", ["mell", "lb"])
def test_an_epoch_plans_the_moves_batch_operations_gives(kind):
    recorder = EpochRecorder(PACKERS[kind](64))
    result = simulate(random_sessions(6), recorder, config(epoch_s=2.0))
    twin = PACKERS[kind](64)
    assert recorder.epochs[0] == []
    for record, operations in zip(result.epochs, recorder.epochs[1:], strict=True):
        plan = batch_operations(twin, operations)
        assert (len(plan.moves), len(plan.unbatched_moves)) == (record.planned_moves, record.unbatched_moves)
    assert sum(len(e) for e in recorder.epochs) > 200 and twin.assignment() == {}


# ---- by hand: C = 100 pages of 10 tokens, 1 token/s, 1 s epochs; five S sessions of 30 pages


def s_bin_case(**changes) -> tuple[list[SessionSpec], PackingSimConfig]:
    sessions = [SessionSpec("s1", 0.0, 290, 2)] + [SessionSpec(f"s{i}", 0.0, 290, 10) for i in range(2, 6)]
    base = dict(
        capacity_pages=100,
        tokens_per_page=10,
        kv_bytes_per_token=1000,
        decode_tokens_per_s=1.0,
        bandwidth_bytes_per_s=1e6,
        rtt_ms=8.0,
        prefill_ms_per_token=10.0,
    )
    return sessions, PackingSimConfig(**(base | changes))


def test_a_refill_moves_one_session_by_kv_and_both_bins_hold_it_while_it_moves():
    sessions, cfg = s_bin_case()
    result = simulate(sessions, MellPacker(BINS[:4], 100), cfg)
    summary = result.summary
    # s1..s3 on gpu00, s4 and s5 on gpu01; s1 departs at t=2 and s4 (292 tokens, 292 KB) refills gpu00 by KV:
    # 292 KB / 1 MB/s + 8 ms = 0.3 s (the replay budget is 0.25 s / 10 ms = 25 tokens)
    assert result.departed_s == {"s1": 2.0, "s2": 10.0, "s3": 10.0, "s4": 10.0, "s5": 10.0}
    assert (summary.kv_migrations, summary.replay_migrations, summary.oversized_migrations) == (1, 0, 0)
    assert summary.mean_migration_s == pytest.approx(0.3)
    assert [r.active_bins for r in result.epochs] == [2] * 10 + [0]
    assert [r.packed_pages for r in result.epochs] == [150, 150] + [120] * 8 + [0]
    assert result.epochs[2].pages_held == 150 and result.epochs[2].page_s == pytest.approx(120 + 30 * 0.3)
    assert summary.duration_s == 10.0 and summary.peak_active_bins == 2 and summary.mean_active_bins == 2.0
    assert summary.peak_bins_lower_bound == 2  # 150 pages on bins of 100
    assert summary.mean_utilization == pytest.approx((300 + 129 + 7 * 120) / (100 * 20))
    assert summary.mean_kv_utilization == summary.mean_utilization  # nothing reserved ahead of the KV
    assert summary.migrations_per_s == pytest.approx(0.1)


def test_sessions_that_reserve_their_final_size_never_grow():
    sessions = random_sessions(7)
    recorder = EpochRecorder(MellPacker(BINS, 64))
    reserved = simulate(sessions, recorder, config(reserve_final=True, check_invariants=True))
    operations = [op for epoch in recorder.epochs for op in epoch]
    assert not any(isinstance(op, Update) for op in operations)
    assert {op.item.item_id: op.item.pages for op in operations if isinstance(op, Allocate)} == {
        s.session_id: -(-s.final_tokens // 16) for s in sessions
    }
    grown = simulate(sessions, MellPacker(BINS, 64), config())
    assert sum(r.packed_pages for r in reserved.epochs) > sum(r.packed_pages for r in grown.epochs)
    assert reserved.summary.completed == len(sessions)
    # the KV fills the same pages either way: a reservation holds pages the KV has not filled yet
    assert [r.kv_pages for r in reserved.epochs] == [r.kv_pages for r in grown.epochs]
    assert [r.kv_pages for r in grown.epochs] == [r.packed_pages for r in grown.epochs]
    assert all(r.kv_pages <= r.packed_pages for r in reserved.epochs)
    assert reserved.summary.mean_kv_utilization < reserved.summary.mean_packed_utilization


def test_a_slow_link_makes_the_refill_a_replay():
    sessions, cfg = s_bin_case(bandwidth_bytes_per_s=1e5, prefill_ms_per_token=0.5)
    summary = simulate(sessions, MellPacker(BINS[:4], 100), cfg).summary
    # KV: 292 KB over a 50 KB budget; replay: 292 tokens within 0.25 s / 0.5 ms = 500, taking 0.146 s
    assert (summary.kv_migrations, summary.replay_migrations) == (0, 1)
    assert summary.mean_migration_s == pytest.approx(0.146)


def test_a_move_no_budget_can_hold_runs_anyway_by_its_faster_mode():
    sessions, cfg = s_bin_case(bandwidth_bytes_per_s=1e5, prefill_ms_per_token=20.0)
    summary = simulate(sessions, MellPacker(BINS[:4], 100), cfg).summary
    # KV 2.928 s vs replay 5.84 s; it fits neither budget (50 KB, 12.5 tokens)
    assert (summary.kv_migrations, summary.oversized_migrations, summary.deferrals) == (1, 1, 0)
    assert summary.mean_migration_s == pytest.approx(2.928)


def test_arrivals_that_find_no_bin_are_rejected_and_a_session_that_cannot_grow_is_evicted():
    sessions, cfg = s_bin_case()
    result = simulate(sessions, MellPacker(BINS[:1], 100), cfg)
    assert result.rejected == ["s4", "s5"] and result.summary.rejected == 2
    assert set(result.departed_s) == {"s1", "s2", "s3"}
    growing = [SessionSpec("a", 0.0, 4, 4), SessionSpec("b", 0.0, 4, 4)]
    tight = config(capacity_pages=10, tokens_per_page=1, decode_tokens_per_s=1.0)
    result = simulate(growing, BestFitPacker(BINS[:1], 10), tight)
    assert result.evicted == ["a"] and result.departed_s == {"a": 1.0, "b": 4.0}
    assert result.summary.completed == 1 and result.summary.max_packed_load_pages <= 10


def test_hops_share_the_budget_of_their_destination_chain_within_an_epoch_and_merge_when_batching():
    costs = MigrationCosts(1000, 1e6, 0.0, 0.01, 1.0)  # KV budget 500 KB per destination, replay 25 tokens
    queue = MigrationQueue(costs, merge=False)
    queue.plan("p", "a", "c")
    queue.plan("q", "b", "c")
    started = queue.start(0.0, lambda s: 300)  # 300 KB each: one fits, the other waits for the next epoch
    assert (started.kv, started.deferred) == (1, 1) and queue.hops["p"][0].end_s == pytest.approx(0.3)
    queue.finish(1.0)
    assert queue.start(1.0, lambda s: 300).kv == 1 and queue.hops["q"][0].start_s == 1.0
    queue.plan("q", "c", "d")  # one by one: hops queue, the second starts when the first ends
    queue.plan("q", "d", "e")
    assert queue.start(1.0, lambda s: 100).kv == 2
    assert [hop.end_s for hop in queue.hops["q"]] == pytest.approx([1.3, 1.4, 1.5])
    assert queue.holdings("q", "e", 1.0) == pytest.approx({"e": 1.0, "b": 0.3, "c": 0.4, "d": 0.5})
    batched = MigrationQueue(costs, merge=True)
    batched.plan("r", "a", "b")
    batched.plan("r", "b", "c")
    assert [(h.src, h.dst) for h in batched.hops["r"]] == [("a", "c")]
    batched.plan("r", "c", "a")
    assert batched.idle()


def test_with_a_room_rule_a_hop_waits_until_its_destination_has_the_pages_and_a_started_one_takes_them():
    queue = MigrationQueue(MigrationCosts(1000, 1e6, 0.0, 0.01, 1.0), merge=True)
    queue.plan("p", "a", "c")
    queue.plan("q", "b", "c")
    queue.plan("r", "d", "c")
    assert queue.waiting_at() == {"p": "a", "q": "b", "r": "d"}
    pages = {"p": 6, "q": 5, "r": 5}.__getitem__
    free = {"c": 5}
    started = queue.start(0.0, lambda s: 100, (free, pages))
    # q fits, and takes c's pages at once (the leader's count): r, as large, and p (6 pages) wait
    assert (started.kv, started.deferred) == (1, 2) and free == {"c": 0, "b": 5}
    assert queue.waiting_at() == {"p": "a", "r": "d"} and queue.on("q", "c") == {"b", "c"}  # q held on both sides
    queue.finish(1.0)
    free = {"c": 6}
    assert queue.start(1.0, lambda s: 100, (free, pages)).kv == 1 and free == {"c": 0, "a": 6}
    assert queue.waiting_at() == {"r": "d"}


def test_lengths_scale_and_clip_to_a_bin_and_the_histogram_counts_final_sizes():
    assert scaled_lengths(100, 20, 4, 10_000) == (400, 80, False)
    assert scaled_lengths(3000, 500, 10, 20_000) == (15_000, 5000, True)  # the prompt loses its start
    assert scaled_lengths(100, 3000, 10, 20_000) == (1, 19_999, True)
    sessions = [SessionSpec("x", 0, 100, 28), SessionSpec("y", 0, 500, 100), SessionSpec("z", 0, 10, 1)]
    counts = class_histogram(sessions, 16, 64)  # 8 pages (C/8: tiny), 38 (over C/2: L) and 1 (tiny)
    assert counts == {"L": 1, "M": 0, "S": 0, "T": 0, "tiny": 2}


def test_a_replayed_live_session_moves_from_where_it_landed_and_decodes_at_its_own_speed():
    # blocks=2: a session of 102 tokens holds 2 x 11 pages; "a" decodes 2 tokens/s, "b" the run's 1 token/s
    sessions = [SessionSpec("a", 0.0, 100, 4, decode_tokens_per_s=2.0, landed="gpu01"),
                SessionSpec("b", 0.0, 100, 3, landed="gpu00")]
    cfg = config(capacity_pages=100, tokens_per_page=10, blocks=2, decode_tokens_per_s=1.0, bandwidth_bytes_per_s=1e6,
                 rtt_ms=8.0, prefill_ms_per_token=10.0)
    recorder = EpochRecorder(BestFitPacker(BINS[:4], 100))
    result = simulate(sessions, recorder, cfg)
    assert recorder.epochs[1] == [Allocate(Item("a", 22)), Allocate(Item("b", 22))]
    assert result.departed_s == {"a": 2.0, "b": 3.0}
    # best fit puts both on gpu00: "b" is where it landed, "a" moves there from gpu01 by KV one epoch later (as live,
    # once its first step arrived), with 102 tokens: 102 KB / 1 MB/s + 8 ms; gpu01 holds it until then
    summary = result.summary
    assert (summary.kv_migrations, summary.replay_migrations, summary.planned_moves) == (1, 0, 1)
    assert summary.mean_migration_s == pytest.approx(0.110)
    assert [r.active_bins for r in result.epochs] == [2, 2, 1, 0]
    one_by_one = simulate(sessions, BestFitPacker(BINS[:4], 100), dataclasses.replace(cfg, batching=False))
    assert one_by_one.summary.kv_migrations == 1 and one_by_one.departed_s == result.departed_s
