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
    groups_of,
    incoming_pages,
    plan_buddy_groups,
    plan_drop,
    plan_merge,
    restore_trigger,
    segments,
    slice_group,
    stale_count,
    victim_moves,
)
from orchestrator.buddy.exchange import VictimMove
from orchestrator.buddy.groups import _refined_slices
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


# ---- a deeper drop: Alg. 1 continued from the groups formed earlier ----

def test_two_pairs_merge_into_four_whose_slices_halve_what_each_member_kept():
    group = replicas(4)
    kept = {"peer-00": (0, 15), "peer-01": (15, 30), "peer-02": (0, 15), "peer-03": (15, 30)}
    assert groups_of(group, kept) == [["peer-00", "peer-01"], ["peer-02", "peer-03"]]
    plan = plan_merge(group, groups_of(group, kept), kept, required_pages=1)
    check_plan(plan, group)
    assert [g.members for g in plan.groups] == [("peer-00", "peer-02", "peer-01", "peer-03")]
    assert plan.kept == {"peer-00": (0, 8), "peer-02": (8, 15), "peer-01": (15, 23), "peer-03": (23, 30)}
    assert plan.total_freed_pages == 3 * 30 * SMOLLM_PARAMS_PAGES  # one copy kept of four


def test_a_pair_and_a_whole_server_merge_into_three_without_loading_a_dropped_block():
    group = replicas(3)
    kept = {"peer-00": (0, 15), "peer-01": (15, 30), "peer-02": (0, 30)}
    plan = plan_merge(group, groups_of(group, kept), kept, required_pages=1)
    check_plan(plan, group)
    assert plan.kept == {"peer-00": (0, 10), "peer-02": (10, 20), "peer-01": (20, 30)}


def test_a_merge_stops_once_it_frees_the_requirement_and_when_no_two_groups_fit_in_one():
    group = replicas(8, end=48)
    kept = {f"peer-{index:02d}": ((0, 24) if index % 2 == 0 else (24, 48)) for index in range(8)}
    one_more = plan_merge(group, groups_of(group, kept), kept, required_pages=1)
    assert sorted(g.size for g in one_more.groups) == [2, 2, 4]  # one merge frees one more copy
    everything = plan_merge(group, groups_of(group, kept), kept, required_pages=10**6)
    assert [g.size for g in everything.groups] == [8] and not everything.meets_requirement
    three_blocks = replicas(4, end=3)
    small = {"peer-00": (0, 2), "peer-01": (2, 3), "peer-02": (0, 2), "peer-03": (2, 3)}
    assert [g.size for g in plan_merge(three_blocks, groups_of(three_blocks, small), small, 10**6).groups] == [2, 2]


def test_slices_that_tile_no_chain_give_no_groups():
    group = replicas(3)
    assert groups_of(group, {"peer-00": (0, 15), "peer-01": (0, 15), "peer-02": (15, 30)}) is None


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 12), st.integers(1, 32), st.integers(1, 5000), st.integers(0, 5000), st.booleans(),
       st.randoms(use_true_random=False))
def test_a_deeper_plan_refines_every_members_slice_and_keeps_every_invariant(count, length, first, more, balanced,
                                                                            rng):
    group = replicas(count, start=3, end=3 + length)
    earlier = plan_drop(group, first, balanced=balanced)
    found = groups_of(group, earlier.kept)
    assert found is not None and sorted(peer for g in found for peer in g) == sorted(earlier.kept)
    for chain in found:  # each a chain of slices that tiles the segment (maybe pairing other servers than the plan)
        assert [earlier.kept[peer][0] for peer in chain[1:]] == [earlier.kept[peer][1] for peer in chain[:-1]]
        assert (earlier.kept[chain[0]][0], earlier.kept[chain[-1]][1]) == (earlier.block_start, earlier.block_end)
    shuffled = list(group)
    rng.shuffle(shuffled)
    plan = plan_merge(shuffled, found, earlier.kept, more)
    assert plan == plan_merge(group, found, dict(earlier.kept), more)  # a pure function of the records
    check_plan(plan, group)
    for peer, (start, end) in plan.kept.items():
        before = earlier.kept[peer]
        assert before[0] <= start < end <= before[1]  # nothing dropped comes back
    gained = plan.total_freed_pages - earlier.total_freed_pages
    if gained < more and len(plan.groups) > 1:  # it merged as far as it could: the two smallest cannot merge
        first, second = sorted(plan.groups, key=lambda g: (g.size, g.members[0]))[:2]
        members = [replica for replica in group if replica.peer_id in first.members + second.members]
        assert first.size + second.size > length or _refined_slices(members, plan.kept) is None


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
    assert not restore_trigger(falling, capacity_undropped_pages=1000, dropped_for_s=5.0, calm_s=0.0)  # too recent
    assert restore_trigger(falling, capacity_undropped_pages=1000, dropped_for_s=12.0, calm_s=0.0)
    assert not restore_trigger([(0.0, 510), (1.0, 510)], capacity_undropped_pages=1000, dropped_for_s=60.0,
                               calm_s=0.0)  # > 50%
    # a group that dropped at 3 of 4 sessions' demand (the drop trigger forecasts a horizon ahead) stays dropped at it
    assert not restore_trigger([(0.0, 90), (20.0, 90)], capacity_undropped_pages=120, dropped_for_s=20.0)
    assert restore_trigger([(0.0, 60), (20.0, 60)], capacity_undropped_pages=120, dropped_for_s=20.0)
    assert not restore_trigger([(0.0, 500), (1.0, 600)], capacity_undropped_pages=1000, dropped_for_s=60.0,
                               calm_s=0.0)  # rising


def test_the_restore_trigger_waits_out_a_lull_between_two_waves():
    # a wave above 50% of 1000 pages until t = 10, then a lull of a few sessions
    wave_then_lull = [(t * 0.5, 900 if t * 0.5 <= 10 else 60) for t in range(0, 51)]  # 0 .. 25 s
    at = {round(time_s, 1): index for index, (time_s, _) in enumerate(wave_then_lull)}
    assert not restore_trigger(wave_then_lull[:at[20.0] + 1], 1000, dropped_for_s=20.0)  # the wave is 10 s old
    assert not restore_trigger(wave_then_lull[:at[24.5] + 1], 1000, dropped_for_s=24.5)  # 14.5 s
    assert restore_trigger(wave_then_lull[:at[25.0] + 1], 1000, dropped_for_s=25.0)  # 15 s of calm
    assert restore_trigger(wave_then_lull[:at[20.0] + 1], 1000, dropped_for_s=20.0, calm_s=5.0)
    # samples that do not reach back over the window (a leader that has just begun) cannot vouch for it
    assert not restore_trigger([(100.0, 60), (100.5, 60)], 1000, dropped_for_s=30.0)
    assert restore_trigger([(85.0, 60), (100.5, 60)], 1000, dropped_for_s=30.0)


def test_stale_samples_are_those_before_the_one_that_reaches_back_over_the_window_and_two_always_stay():
    samples = [(float(t), 1) for t in range(10)]
    assert stale_count(samples, keep_s=3.0) == 6  # 6.0 .. 9.0 stay
    assert stale_count(samples, keep_s=2.5) == 6  # 6.0 stays: 7.0 .. 9.0 alone would not reach back 2.5 s
    assert stale_count(samples, keep_s=100.0) == 0
    assert stale_count(samples, keep_s=0.0) == 8
    assert stale_count(samples[:2], keep_s=0.0) == 0


# ---- victims ----

def test_victims_send_the_kv_of_the_blocks_their_server_dropped_to_the_buddy_that_keeps_them():
    plan = plan_drop(replicas(3, end=9), required_pages=10**6)  # one group: 0:3, 3:6, 6:9
    moves = victim_moves(plan, {"peer-01": [("big", 300), ("small", 20)]}, kv_bytes_per_token_block=1536)
    assert [(m.session_id, m.dst, m.block_start, m.block_end) for m in moves] == [
        ("small", "peer-00", 0, 3), ("small", "peer-02", 6, 9), ("big", "peer-00", 0, 3), ("big", "peer-02", 6, 9)]
    assert moves[0].kv_bytes == 20 * 3 * 1536


def test_each_member_holds_back_the_kv_its_mates_victims_bring_for_the_blocks_it_keeps():
    """Spec 5.2's pair: each server keeps half and takes the other's KV over that half; a third member splits what it
    sends between the two that keep its dropped blocks; an idle member sends nothing."""
    pair = plan_drop(replicas(2), required_pages=1)  # 0:15 and 15:30
    whole = {peer: (0, 30) for peer in pair.kept}
    assert incoming_pages(pair, whole, {"peer-00": 360, "peer-01": 360}) == {"peer-00": 180, "peer-01": 180}
    assert incoming_pages(pair, whole, {"peer-00": 360, "peer-01": 0}) == {"peer-00": 0, "peer-01": 180}
    three = plan_drop(replicas(3, end=9), required_pages=10**6)  # 0:3, 3:6, 6:9
    assert incoming_pages(three, {peer: (0, 9) for peer in three.kept}, {"peer-01": 90}) == {
        "peer-00": 30, "peer-01": 0, "peer-02": 30}


def test_two_pairs_merging_hold_back_only_the_kv_of_the_blocks_dropped_now():
    """From pairs (each member serving half), a merge into four moves only the quarter each member drops now."""
    replicas_ = replicas(4, end=8)
    kept = {"peer-00": (0, 4), "peer-01": (4, 8), "peer-02": (0, 4), "peer-03": (4, 8)}
    plan = plan_merge(replicas_, groups_of(replicas_, kept), kept, required_pages=1)
    incoming = incoming_pages(plan, kept, dict.fromkeys(kept, 40))
    # every member drops 2 of its 4 blocks (20 of its 40 pages), each to the member that keeps them now
    assert sum(incoming.values()) == 80 and all(pages == 20 for pages in incoming.values())
    for peer, (first, last) in plan.kept.items():
        assert kept[peer][0] <= first < last <= kept[peer][1]  # a member keeps a part of what it kept


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
