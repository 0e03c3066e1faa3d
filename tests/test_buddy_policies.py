"""KunServe's pure policies (orchestrator/buddy): the drop and restore triggers, Alg. 1 and its balanced variant,
slicing, the plan's invariants, and the victims' moves, order and mode."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.buddy import (
    DropPlan,
    PlanError,
    PlanViolation,
    SegmentReplica,
    check_plan,
    drop_trigger,
    exchange_mode,
    exchange_order,
    plan_buddy_groups,
    plan_drop,
    restore_trigger,
    segments,
    slice_group,
    victim_moves,
)
from orchestrator.buddy.exchange import VictimMove
from orchestrator.packing import MigrationCosts

SMOLLM_PARAMS_PAGES = 14  # one SmolLM2-135M block in float32, in pages of 1 MiB (spec 5.2)


def replicas(count: int, *, start: int = 0, end: int = 30, pages: int = SMOLLM_PARAMS_PAGES) -> list[SegmentReplica]:
    return [SegmentReplica(f"peer-{index:02d}", start, end, pages) for index in range(count)]


# ---- Alg. 1, exactly as the paper writes it ----

def test_alg1_pairs_first_and_frees_one_copy_per_merge():
    plan = plan_buddy_groups(replicas(8), required_pages=3 * 30 * SMOLLM_PARAMS_PAGES, balanced=False)
    assert sorted(group.size for group in plan) == [1, 1, 2, 2, 2]
    assert [group.members for group in plan if group.size == 2] == [
        ("peer-00", "peer-01"), ("peer-02", "peer-03"), ("peer-04", "peer-05")]


def test_alg1_is_not_depth_balanced_past_half_the_servers_and_the_balanced_variant_is():
    required = 5 * 30 * SMOLLM_PARAMS_PAGES  # five merges of eight servers
    greedy = plan_buddy_groups(replicas(8), required, balanced=False)
    balanced = plan_buddy_groups(replicas(8), required, balanced=True)
    assert sorted(group.size for group in greedy) == [2, 2, 4]  # the spec's example
    assert sorted(group.size for group in balanced) == [2, 3, 3]


def test_a_requirement_no_grouping_meets_merges_everything_and_says_so():
    plan = plan_drop(replicas(3), required_pages=10**6, balanced=False)
    assert [group.size for group in plan.groups] == [3]
    assert not plan.meets_requirement
    assert plan.total_freed_pages == 2 * 30 * SMOLLM_PARAMS_PAGES


def test_no_requirement_no_drop():
    plan = plan_drop(replicas(4), required_pages=0)
    assert not plan.changes_anything and plan.total_freed_pages == 0
    assert all(kept == (0, 30) for kept in plan.kept.values())


def test_a_group_never_has_more_members_than_the_segment_has_blocks():
    plan = plan_drop(replicas(5, start=10, end=12), required_pages=10**6, balanced=False)
    assert max(group.size for group in plan.groups) == 2
    check_plan(plan, replicas(5, start=10, end=12))


# ---- slicing ----

def test_equal_slices_tile_the_segment_and_the_first_members_take_the_extra_blocks():
    assert slice_group(replicas(4, start=3, end=13)) == {
        "peer-00": (3, 6), "peer-01": (6, 9), "peer-02": (9, 11), "peer-03": (11, 13)}


def test_slices_by_speed_give_the_faster_server_more_blocks():
    fast = SegmentReplica("fast", 0, 30, SMOLLM_PARAMS_PAGES, tau_p_ms=1.0)
    slow = SegmentReplica("slow", 0, 30, SMOLLM_PARAMS_PAGES, tau_p_ms=2.0)
    assert slice_group([slow, fast], by_speed=True) == {"slow": (0, 10), "fast": (10, 30)}


def test_the_spec_example_pair_frees_half_of_each_servers_parameters():
    plan = plan_drop(replicas(2), required_pages=200)
    assert plan.kept == {"peer-00": (0, 15), "peer-01": (15, 30)}
    assert plan.freed_pages == {"peer-00": 210, "peer-01": 210}  # spec 5.2: 15 blocks x 14 pages each
    assert plan.dropped == {"peer-00": ((15, 30),), "peer-01": ((0, 15),)}


# ---- invariants, over random records ----

replica_sets = st.builds(
    lambda count, start, length, pages, speeds, draining: [
        SegmentReplica(f"p{index}", start, start + length, pages[index], tau_p_ms=speeds[index],
                       draining=index in draining)
        for index in range(count)
    ],
    count=st.integers(1, 12),
    start=st.integers(0, 20),
    length=st.integers(1, 32),
    pages=st.lists(st.integers(1, 40), min_size=12, max_size=12),
    speeds=st.lists(st.floats(0.1, 10.0), min_size=12, max_size=12),
    draining=st.sets(st.integers(0, 11), max_size=4),
)


@settings(max_examples=300, deadline=None)
@given(replica_sets, st.integers(0, 5000), st.booleans(), st.booleans())
def test_every_plan_tiles_each_group_frees_exactly_its_dropped_pages_and_covers_every_block(
    group, required, balanced, by_speed
):
    if all(replica.draining for replica in group):
        return
    plan = plan_drop(group, required, balanced=balanced, by_speed=by_speed)
    check_plan(plan, group)
    for peer, parts in plan.dropped.items():
        kept = plan.kept[peer]
        assert sum(b - a for a, b in parts) + kept[1] - kept[0] == plan.block_end - plan.block_start
    assert plan.meets_requirement == (plan.total_freed_pages >= required)
    if not plan.meets_requirement:  # then it merged as far as it can while every member keeps a block
        active = [replica for replica in group if not replica.draining]
        blocks = plan.block_end - plan.block_start
        if balanced:  # the fewest groups there can be
            assert len(plan.groups) == math.ceil(len(active) / blocks)
        else:  # Alg. 1 stops when its two smallest groups would not fit in one (6 servers, 3 blocks: three pairs)
            sizes = sorted(g.size for g in plan.groups)
            assert len(sizes) == 1 or sizes[0] + sizes[1] > blocks


@settings(max_examples=200, deadline=None)
@given(replica_sets, st.integers(0, 5000), st.booleans(), st.randoms(use_true_random=False))
def test_a_plan_is_a_pure_function_of_the_records_whatever_their_order(group, required, balanced, rng):
    if all(replica.draining for replica in group):
        return
    shuffled = list(group)
    rng.shuffle(shuffled)
    assert plan_drop(shuffled, required, balanced=balanced) == plan_drop(group, required, balanced=balanced)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 16), st.integers(1, 30 * 15 * SMOLLM_PARAMS_PAGES))
def test_with_alike_servers_both_variants_make_the_fewest_merges_that_cover_the_requirement(count, required):
    group = replicas(count)
    merges_needed = min(count - 1, math.ceil(required / (30 * SMOLLM_PARAMS_PAGES)))
    for balanced in (False, True):
        groups = plan_buddy_groups(group, required, balanced=balanced)
        assert count - len(groups) == merges_needed
        if balanced:
            sizes = [g.size for g in groups]
            assert max(sizes) - min(sizes) <= 1


def test_a_plan_never_leans_on_a_draining_server():
    group = replicas(3)
    group[2] = SegmentReplica("peer-02", 0, 30, SMOLLM_PARAMS_PAGES, draining=True)
    plan = plan_drop(group, required_pages=10**6)
    assert "peer-02" not in plan.kept
    assert [g.members for g in plan.groups] == [("peer-00", "peer-01")]


def test_check_plan_catches_a_gap_and_a_wrong_page_count():
    group = replicas(2)
    good = plan_drop(group, required_pages=200)
    gap = DropPlan(0, 30, good.groups, {"peer-00": (0, 14), "peer-01": (15, 30)}, {"peer-00": 224, "peer-01": 210}, 200)
    with pytest.raises(PlanViolation, match="should start at 14"):
        check_plan(gap, group)
    miscounted = DropPlan(0, 30, good.groups, good.kept, {"peer-00": 210, "peer-01": 0}, 200)
    with pytest.raises(PlanViolation, match="frees 0 pages"):
        check_plan(miscounted, group)


def test_replicas_of_different_segments_or_a_server_twice_are_refused():
    with pytest.raises(PlanError, match="different segments"):
        plan_drop([*replicas(1), SegmentReplica("x", 0, 10, 1)], 1)
    with pytest.raises(PlanError, match="twice"):
        plan_drop(replicas(1) + replicas(1), 1)
    assert list(segments([*replicas(2), SegmentReplica("x", 0, 10, 1)])) == [(0, 10), (0, 30)]


# ---- triggers ----

def test_the_drop_trigger_forecasts_one_second_with_the_latest_rates():
    demand = [(0.0, 500), (0.5, 600)]  # +200 pages/s
    available = [(0.0, 700), (0.5, 700)]
    assert drop_trigger(demand, available) == 100  # 600 + 200 - 700
    assert drop_trigger([(0.0, 500), (0.5, 500)], available) == 0  # demand steady below what is available
    # availability falling (blocks loading, say) by 20 pages/s: the shortfall is against the forecast, 660
    assert drop_trigger([(0.0, 690)], [(0.0, 700), (1.0, 680)]) == 30


def test_the_restore_trigger_waits_for_the_drop_to_age_and_for_room_with_a_margin():
    falling = [(0.0, 400), (1.0, 300)]
    assert not restore_trigger(falling, capacity_undropped_pages=1000, dropped_for_s=5.0)  # too recent
    assert restore_trigger(falling, capacity_undropped_pages=1000, dropped_for_s=12.0)
    assert not restore_trigger([(0.0, 810), (1.0, 810)], capacity_undropped_pages=1000, dropped_for_s=60.0)  # > 80%
    assert not restore_trigger([(0.0, 500), (1.0, 600)], capacity_undropped_pages=1000, dropped_for_s=60.0)  # rising


# ---- victims ----

def test_victims_send_the_kv_of_the_blocks_their_server_dropped_to_the_buddy_that_keeps_them():
    plan = plan_drop(replicas(3, end=9), required_pages=10**6)  # one group: 0:3, 3:6, 6:9
    moves = victim_moves(plan, {"peer-01": [("big", 300), ("small", 20)]}, kv_bytes_per_token_block=1536)
    assert [(m.session_id, m.dst, m.block_start, m.block_end) for m in moves] == [
        ("small", "peer-00", 0, 3), ("small", "peer-02", 6, 9), ("big", "peer-00", 0, 3), ("big", "peer-02", 6, 9)]
    assert moves[0].kv_bytes == 20 * 3 * 1536


def test_exchange_order_is_session_by_session_smallest_first():
    moves = [VictimMove("a", "s", "d", 0, 5, 10, 500), VictimMove("b", "s", "d", 0, 5, 10, 100),
             VictimMove("a", "s", "e", 5, 9, 10, 50)]
    assert [(m.session_id, m.block_start) for m in exchange_order(moves)] == [("b", 0), ("a", 0), ("a", 5)]


def test_exchange_mode_replays_when_the_bytes_are_slower_and_goes_live_only_within_the_slack():
    slow_link = MigrationCosts(kv_bytes_per_token=15 * 1536, bandwidth_bytes_per_s=1e6, rtt_s=0.02,
                               prefill_s_per_token=1e-4, epoch_s=1.0)
    fast_link = MigrationCosts(kv_bytes_per_token=15 * 1536, bandwidth_bytes_per_s=1e9, rtt_s=0.001,
                               prefill_s_per_token=1e-2, epoch_s=1.0)
    assert exchange_mode(slow_link, 500, rtt_ms=20, pending_blocks=15, tbt_slack_ms=100) == "replay"
    assert exchange_mode(fast_link, 500, rtt_ms=1, pending_blocks=15, tbt_slack_ms=100) == "blocking"
    assert exchange_mode(fast_link, 500, rtt_ms=1, pending_blocks=15, tbt_slack_ms=100, live=True) == "live"
    assert exchange_mode(fast_link, 500, rtt_ms=20, pending_blocks=15, tbt_slack_ms=100, live=True) == "blocking"


def test_random_plans_move_every_victim_block_exactly_once():
    rng = random.Random(13)
    for _ in range(50):
        group = replicas(rng.randint(2, 6), end=rng.randint(6, 30))
        plan = plan_drop(group, required_pages=rng.randint(1, 2000))
        sessions = {r.peer_id: [(f"{r.peer_id}-s{i}", rng.randint(1, 500)) for i in range(rng.randint(0, 3))]
                    for r in group}
        moves = victim_moves(plan, sessions, 1536)
        for peer, running in sessions.items():
            for session_id, _ in running:
                moved = sorted((m.block_start, m.block_end) for m in moves if m.session_id == session_id)
                covered = [block for a, b in moved for block in range(a, b)]
                assert sorted(covered) == [b for a, b in plan.dropped[peer] for b in range(a, b)]
                assert all(plan.kept[m.dst][0] <= m.block_start < m.block_end <= plan.kept[m.dst][1]
                           for m in moves if m.session_id == session_id)
