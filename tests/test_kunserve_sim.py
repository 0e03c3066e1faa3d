"""The KunServe simulator: replicas that throttle on KV pages under a burst, the live policies merging them into
buddy groups and splitting them back, and its two baselines, on small deterministic workloads."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from orchestrator.admission import NAMED_ROOM_GRACE_S
from orchestrator.sim.kunserve_sim import (
    KunServeSimConfig,
    SimRequest,
    _Batch,
    _Running,
    _Sim,
    decode_rows_ms,
    link_extra_s,
    simulate,
)

# 4 replicas of 8 blocks; 100 pages each, 40 of parameters: 60 KV pages, 7 requests of 64 tokens (8 pages) each.
CONFIG = KunServeSimConfig(
    replicas=4, blocks=8, pages_total=100, params_pages=40, tokens_per_page=64, step_ms=10.0,
    prefill_token_ms=0.05, decode_token_ms=0.1, hop_ms=1.0, link_bytes_per_s=1e9, prefill_chunk_tokens=256,
    restore_after_s=2.0, restore_calm_s=1.0,
)


def burst(calm: int = 20, burst: int = 60) -> list[SimRequest]:
    """A calm rate, then a burst of `burst` requests within 0.2 s, then calm again."""
    requests = [SimRequest(0.5 * i, 16, 48) for i in range(calm)]
    requests += [SimRequest(10.0 + 0.2 * i / burst, 16, 48) for i in range(burst)]
    requests += [SimRequest(12.0 + 0.5 * i, 16, 48) for i in range(calm)]
    return sorted(requests, key=lambda r: r.arrival_s)


def test_every_request_is_served_once_with_its_tokens_timed() -> None:
    result = simulate(CONFIG, burst())
    assert np.isfinite(result.ttft_s).all() and np.isfinite(result.tbt_s).all()
    assert (result.ttft_s > 0).all() and (result.tbt_s >= CONFIG.step_ms / 1000).all()
    assert result.end_s >= max(r.arrival_s for r in burst())


def test_a_burst_makes_the_replicas_drop_and_restore_and_cuts_the_tail_ttft() -> None:
    requests = burst()
    kunserve = simulate(CONFIG, requests)
    no_drop = simulate(dataclasses.replace(CONFIG, dropping=False), requests)
    assert kunserve.drops >= 1 and kunserve.restores == kunserve.drops and kunserve.largest_group >= 2
    assert no_drop.drops == 0 and no_drop.stalls_s == ()
    assert kunserve.percentile(kunserve.ttft_s, 99) < no_drop.percentile(no_drop.ttft_s, 99)
    assert len(kunserve.stalls_s) >= 1 and min(kunserve.stalls_s) > 0  # victims waited for their KV
    # capacity grew by the dropped copies' parameter pages while dropped, and came back after
    capacities = {capacity for _, _, capacity in kunserve.samples}
    assert 4 * 60 in capacities and max(capacities) > 4 * 60


@pytest.mark.parametrize("members", [False, True], ids=["micro-batches", "member-batching"])
def test_a_static_pipeline_pays_its_hops_when_unloaded(members: bool) -> None:
    calm = [SimRequest(1.0 * i, 16, 48) for i in range(10)]
    replicas = simulate(dataclasses.replace(CONFIG, dropping=False), calm)
    pipeline = simulate(dataclasses.replace(CONFIG, static_groups=2, member_batching=members), calm)
    assert pipeline.drops == 0
    extra_ms = (np.nanmedian(pipeline.tbt_s) - np.nanmedian(replicas.tbt_s)) * 1000
    assert extra_ms == pytest.approx(CONFIG.hop_ms)  # one more member, one hop per token
    # the prompt's hidden states go through the client between members batching on their own: two hops
    extra_ms = (np.nanmedian(pipeline.ttft_s) - np.nanmedian(replicas.ttft_s)) * 1000
    assert extra_ms == pytest.approx(2 * CONFIG.hop_ms if members else CONFIG.hop_ms)


@pytest.mark.parametrize("members", [False, True], ids=["micro-batches", "member-batching"])
def test_a_groups_prompt_tokens_cost_what_members_measured_and_a_whole_replicas_do_not(members: bool) -> None:
    calm = [SimRequest(1.0 * i, 16, 48) for i in range(10)]
    member_ms = 3 * CONFIG.prefill_token_ms
    measured = dataclasses.replace(CONFIG, member_prefill_token_ms=member_ms)
    replicas = [simulate(dataclasses.replace(config, dropping=False), calm) for config in (CONFIG, measured)]
    assert np.array_equal(replicas[0].ttft_s, replicas[1].ttft_s)
    pipelines = [simulate(dataclasses.replace(config, static_groups=2, member_batching=members), calm)
                 for config in (CONFIG, measured)]
    extra_ms = (np.nanmedian(pipelines[1].ttft_s) - np.nanmedian(pipelines[0].ttft_s)) * 1000
    assert extra_ms == pytest.approx(16 * (member_ms - CONFIG.prefill_token_ms))  # its 16 prompt tokens, all blocks


def test_the_simulation_is_a_pure_function_of_its_inputs() -> None:
    first, second = simulate(CONFIG, burst()), simulate(CONFIG, burst())
    assert np.array_equal(first.ttft_s, second.ttft_s) and first.samples == second.samples


def test_bad_configurations_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of blocks"):
        dataclasses.replace(CONFIG, params_pages=41)
    with pytest.raises(ValueError, match="member_prefill_token_ms"):
        dataclasses.replace(CONFIG, member_prefill_token_ms=-1.0)
    with pytest.raises(ValueError, match="divide"):
        dataclasses.replace(CONFIG, static_groups=3)
    with pytest.raises(ValueError, match="cores"):
        dataclasses.replace(CONFIG, cores=0)
    with pytest.raises(ValueError, match="placement"):
        dataclasses.replace(CONFIG, placement="random")


def test_clients_that_back_off_are_served_later_than_a_queue_and_still_trigger_drops() -> None:
    requests = burst()
    queue = simulate(dataclasses.replace(CONFIG, dropping=False), requests)
    backoff = simulate(dataclasses.replace(CONFIG, dropping=False, retry_backoff_s=(0.5, 4.0)), requests)
    assert np.isfinite(backoff.ttft_s).all()
    assert backoff.percentile(backoff.ttft_s, 99) >= queue.percentile(queue.ttft_s, 99)
    dropping = simulate(dataclasses.replace(CONFIG, retry_backoff_s=(0.5, 4.0)), requests)
    assert dropping.drops >= 1
    assert dropping.percentile(dropping.ttft_s, 99) < backoff.percentile(backoff.ttft_s, 99)


def test_a_tokens_round_trip_delays_it_but_leaves_its_server_free_for_other_requests() -> None:
    lone_replica = dataclasses.replace(CONFIG, replicas=1, dropping=False, round_trip_ms=100.0)
    first = SimRequest(0.0, 16, 48)
    alone = simulate(lone_replica, [first])
    without = simulate(dataclasses.replace(lone_replica, round_trip_ms=0.0), [first])
    assert alone.tbt_s[0] - without.tbt_s[0] == pytest.approx(0.1)  # every token waits its round trip
    assert alone.ttft_s[0] - without.ttft_s[0] == pytest.approx(0.1)
    # a second request arriving mid-way through the first's round trip computes while the first's token travels:
    # the first request's pace does not change
    both = simulate(lone_replica, [first, SimRequest(0.05, 16, 48)])
    assert both.tbt_s[0] == pytest.approx(alone.tbt_s[0])
    assert np.isfinite(both.tbt_s).all()


def test_a_burst_that_outgrows_the_first_plan_merges_the_replicas_still_whole_then_the_pairs() -> None:
    requests = [SimRequest(0.5 * i, 16, 48) for i in range(10)]
    for step in range(1, 7):  # the rate climbs for 3 s: 12, 24, .. 72 requests a second
        requests += [SimRequest(5.0 + 0.5 * (step - 1) + 0.5 * j / (6 * step), 16, 48) for j in range(6 * step)]
    requests += [SimRequest(9.0 + 0.5 * i, 16, 48) for i in range(20)]
    requests.sort(key=lambda r: r.arrival_s)
    result = simulate(CONFIG, requests)
    # the first drop pairs two replicas (+40 pages), the second the two still whole, the third merges the pairs
    # into a group of four (plan_merge: +40 more); one restore takes all back
    assert (result.drops, result.restores, result.largest_group) == (3, 1, 4)
    capacities = [capacity for _, _, capacity in result.samples]
    changes = [capacity for before, capacity in itertools.pairwise(capacities) if capacity != before]
    assert changes == [280, 320, 360, 240]
    assert np.isfinite(result.ttft_s).all()


def test_arrivals_go_to_the_unit_with_the_fewest_requests_per_member_among_those_with_room() -> None:
    sim = _Sim(CONFIG, [], horizon_s=1.0)
    pair = sim._add_unit((4, 5))  # a group: 2 x 100 - 40 = 160 KV pages, two members' compute
    units = list(sim.units.values())
    small = SimRequest(0.0, 16, 48)  # 8 pages
    units[0].running += [_Running(i, small, 8) for i in range(3)]  # 3 requests, 36 pages free
    units[1].running += [_Running(3, small, 48)]  # 1 request, 12 pages free
    units[2].running += [_Running(4, small, 8), _Running(5, small, 8)]  # 2 requests, 44 free
    units[3].running += [_Running(6, small, 56)]  # 1 request, 4 free: no room for 8 pages
    pair.running += [_Running(7 + i, small, 8) for i in range(4)]  # 2 a member, 128 free
    # not the freest (the pair), not one without room (units[3]): the least loaded per member that fits
    assert sim._place(8) is units[1]
    assert sim._place(20) is pair  # units[2] and the pair run 2 a member: the more free pages decide
    assert sim._place(200) is None


def test_clients_routing_by_latency_take_the_oldest_whole_replica_until_it_refuses_them() -> None:
    sim = _Sim(dataclasses.replace(CONFIG, placement="fewest_hops"), [], horizon_s=1.0)
    pair = sim._add_unit((4, 5))  # a group: 160 KV pages, but a chain of two members
    units = list(sim.units.values())
    small = SimRequest(0.0, 16, 48)
    units[0].running += [_Running(i, small, 8) for i in range(5)]  # the busiest replica, 20 pages free
    assert sim._place(8) is units[0]  # its load does not show in the records the clients route by
    assert sim._place(24) is units[1]  # it refuses: the next whole replica
    units[1].running += [_Running(5, small, 60)]
    units[2].running += [_Running(6, small, 60)]
    units[3].running += [_Running(7, small, 60)]
    assert sim._place(24) is pair  # a group only when no whole replica has room
    assert sim._place(200) is None


def test_on_shared_cores_work_runs_slower_while_more_processes_compute_than_there_are_cores() -> None:
    two = dataclasses.replace(CONFIG, replicas=2, dropping=False)
    requests = [SimRequest(0.0, 16, 48), SimRequest(0.0, 16, 48)]  # one on each replica, computing side by side
    apart = simulate(two, requests)
    assert np.array_equal(simulate(dataclasses.replace(two, cores=2), requests).tbt_s, apart.tbt_s)
    one_core = simulate(dataclasses.replace(two, cores=1), requests)
    # both replicas compute every iteration together: on one core each takes twice its time
    assert one_core.tbt_s == pytest.approx(2 * apart.tbt_s)
    # the client's work is a process too: each member computing a batch and a busy client count one
    sim = _Sim(dataclasses.replace(CONFIG, cores=2), [], horizon_s=1.0)
    assert sim._sharing(client=True) == 1.0
    sim.computing = {0, 1}
    assert (sim._sharing(client=False), sim._sharing(client=True)) == (1.0, 1.5)
    sim.computing |= {2, 3}  # the members of a group that batch on their own compute side by side, each its slice
    assert sim._sharing(client=True) == 2.5
    sim._add_unit((4, 5)).batches = 2  # a group that pipelines micro-batches: each in flight counts one
    assert sim._sharing(client=True) == 3.5
    assert _Sim(CONFIG, [], horizon_s=1.0)._sharing(client=True) == 1.0  # without cores: a processor each


def test_once_every_core_computes_work_takes_the_measured_corun_stretch_and_a_share_of_it_before() -> None:
    sim = _Sim(dataclasses.replace(CONFIG, cores=2, corun_stretch=1.1, token_cpu_ms=100.0), [], horizon_s=1.0)
    assert sim._sharing(client=False) == 1.0  # nothing else computes: alone
    sim.computing = {0}
    assert sim._sharing(client=False) == 1.0  # one process: alone on its core
    assert sim._sharing(client=True) == pytest.approx(1.1)  # and the client: every core computes
    sim.computing = {0, 1, 2}
    assert sim._sharing(client=False) == pytest.approx(1.5 * 1.1)  # beyond the cores: their share, and the host's
    sim.computing = {0}
    sim.tokens_seen.extend([0.0] * 5)  # half a core of other work in the last second
    sim.now = 0.5
    assert sim._sharing(client=False) == pytest.approx(1.05)  # 1.5 processes: half the way to every core
    with pytest.raises(ValueError, match="corun_stretch"):
        dataclasses.replace(CONFIG, corun_stretch=0.0)
    # end to end: two replicas computing side by side on two cores each take the stretch, one alone does not
    two = dataclasses.replace(CONFIG, replicas=2, dropping=False, cores=2, corun_stretch=1.1)
    side_by_side = [SimRequest(0.0, 16, 48), SimRequest(0.0, 16, 48)]
    assert simulate(two, side_by_side).compute_stretch == pytest.approx(1.1, rel=0.01)
    assert simulate(two, side_by_side[:1]).compute_stretch == pytest.approx(1.0)
    # measured as 1: the cores' sharing alone, as before
    plain = dataclasses.replace(two, corun_stretch=1.0)
    assert simulate(plain, side_by_side).compute_stretch == pytest.approx(1.0)


def test_a_decode_batch_costs_its_rows_on_the_batching_curve_and_beside_prompt_tokens_a_row_each() -> None:
    curved = dataclasses.replace(CONFIG, decode_rows_ms=((1, 2.0), (8, 9.0), (32, 12.0)))
    assert [decode_rows_ms(curved, rows) for rows in (0, 1, 4, 8, 20, 32, 64)] == pytest.approx(
        [0.0, 2.0, 5.0, 9.0, 10.5, 12.0, 16.0])  # between the points linear, beyond the last along its slope
    assert decode_rows_ms(CONFIG, 4) == pytest.approx(0.4)  # without points: `decode_token_ms` a row
    for bad in (((0, 1.0),), ((8, 2.0), (1, 1.0)), ((1, 2.0), (8, 1.0))):
        with pytest.raises(ValueError, match="decode_rows_ms"):
            dataclasses.replace(CONFIG, decode_rows_ms=bad)
    sim = _Sim(curved, [], horizon_s=1.0)
    decoding = [(_Running(n, SimRequest(0.0, 16, 48), 8, prefilled=16), 1) for n in range(4)]
    prompt = (_Running(4, SimRequest(0.0, 16, 48), 8), 16)
    assert sim._work(decoding, 1)[0] == pytest.approx(10.0 + 5.0)  # the fixed step and four rows on the curve
    assert sim._work([*decoding, prompt], 1)[0] == pytest.approx(10.0 + 0.4 + 16 * 0.05)  # a wide batch: a row each


def test_the_compute_stretch_is_how_much_longer_the_batches_took_than_their_work_on_shared_cores() -> None:
    two = dataclasses.replace(CONFIG, replicas=2, dropping=False)
    requests = [SimRequest(0.0, 16, 48), SimRequest(0.0, 16, 48)]  # one on each replica, computing side by side
    assert simulate(two, requests).compute_stretch == pytest.approx(1.0)  # a processor each
    # on one core about twice (a batch that starts while the other replica is between two takes the core alone)
    assert simulate(dataclasses.replace(two, cores=1), requests).compute_stretch == pytest.approx(2.0, rel=0.02)
    assert np.isnan(simulate(two, []).compute_stretch)  # nothing computed


def test_the_other_works_weight_counts_its_cores_that_many_times_against_the_computing_processes() -> None:
    config = dataclasses.replace(CONFIG, cores=2, retry_backoff_s=(0.5, 4.0), refused_try_cpu_ms=250.0,
                                 token_cpu_ms=50.0)
    sim = _Sim(dataclasses.replace(config, other_work_weight=3.0), [], horizon_s=10.0)
    sim.computing = {0, 1}
    sim.refused_tries.extend([0.0, 0.2])  # half a core within the last second
    sim.tokens_seen.extend([0.1] * 4)  # and 0.2 of a core
    sim.now = 0.5
    assert sim._sharing(client=False) == pytest.approx((2 + 3 * 0.7) / 2)
    with pytest.raises(ValueError, match="other_work_weight"):
        dataclasses.replace(config, other_work_weight=-1.0)
    # end to end: waiting clients' refused tries slow the running requests more, the heavier they weigh
    lone = dataclasses.replace(config, replicas=1, dropping=False, cores=1)
    requests = [SimRequest(0.0, 200, 200)] + [SimRequest(0.1 * i, 200, 4) for i in range(1, 9)]
    light, heavy = (simulate(dataclasses.replace(lone, other_work_weight=w), requests) for w in (1.0, 4.0))
    assert heavy.compute_stretch > light.compute_stretch > 1.0
    assert heavy.tbt_s[0] > light.tbt_s[0]


def test_with_fluid_sharing_a_batch_shares_the_cores_with_what_computes_beside_it_at_each_moment() -> None:
    two = dataclasses.replace(CONFIG, replicas=2, dropping=False, cores=1)
    requests = [SimRequest(0.0, 240, 1), SimRequest(0.0, 16, 1)]  # one on each replica, both prompts at once
    # 22 ms and 10.8 ms of their own on one core. Taken at its start, the long prompt's batch (started first, alone)
    # keeps its full speed although the short one's started beside it at once
    assert simulate(two, requests).ttft_s.tolist() == pytest.approx([0.022, 0.0216])
    # fluid: both at half speed until the short one ends (at 21.6 ms, with 10.8 ms of the long one done), then alone
    fluid = simulate(dataclasses.replace(two, fluid_sharing=True), requests)
    assert fluid.ttft_s.tolist() == pytest.approx([0.0216 + 0.0112, 0.0216])
    # without shared cores there is nothing to share
    apart = dataclasses.replace(two, cores=None)
    assert np.array_equal(simulate(dataclasses.replace(apart, fluid_sharing=True), requests).ttft_s,
                          simulate(apart, requests).ttft_s)


def test_on_shared_cores_the_tries_refused_in_the_last_second_take_cpu_from_the_work_that_runs() -> None:
    config = dataclasses.replace(CONFIG, cores=2, retry_backoff_s=(0.5, 4.0), refused_try_cpu_ms=250.0)
    sim = _Sim(config, [], horizon_s=10.0)
    sim.computing = {0, 1, 2}
    sim.refused_tries.extend([0.0, 0.2])
    sim.now = 0.5  # two refused tries of 250 ms of CPU each within the last second: half a core
    assert sim._sharing(client=False) == pytest.approx((3 + 0.5) / 2)
    sim.now = 1.1  # the first is older than a second
    assert sim._sharing(client=False) == pytest.approx((3 + 0.25) / 2)
    sim.now = 1.3
    assert sim._sharing(client=False) == pytest.approx(3 / 2)
    # end to end: one replica with room for one request at a time, a long one running while others wait
    lone = dataclasses.replace(CONFIG, replicas=1, dropping=False, retry_backoff_s=(0.5, 4.0), cores=1)
    requests = [SimRequest(0.0, 200, 200)] + [SimRequest(0.1 * i, 200, 4) for i in range(1, 9)]
    free = simulate(lone, requests)
    loaded = simulate(dataclasses.replace(lone, refused_try_cpu_ms=200.0), requests)
    assert loaded.tbt_s[0] > free.tbt_s[0] * 1.05  # the waiters' tries slow the request that runs
    # without shared cores (a processor each) the tries cost the servers nothing
    apart = dataclasses.replace(lone, cores=None)
    assert np.array_equal(simulate(dataclasses.replace(apart, refused_try_cpu_ms=200.0), requests).tbt_s,
                          simulate(apart, requests).tbt_s)
    with pytest.raises(ValueError, match="refused_try_cpu_ms"):
        dataclasses.replace(lone, refused_try_cpu_ms=-1.0)


def test_on_shared_cores_the_tokens_of_the_last_second_take_their_transports_cpu_from_the_work_that_runs() -> None:
    config = dataclasses.replace(CONFIG, cores=2, token_cpu_ms=100.0)
    sim = _Sim(config, [], horizon_s=10.0)
    sim.computing = {0, 1, 2}
    sim.tokens_seen.extend([0.0, 0.1, 0.2, 0.3])
    sim.now = 0.5  # four tokens of 100 ms of CPU each within the last second: 0.4 of a core
    assert sim._sharing(client=False) == pytest.approx((3 + 0.4) / 2)
    sim.now = 1.25  # the first three are older than a second
    assert sim._sharing(client=False) == pytest.approx((3 + 0.1) / 2)
    # end to end: the tokens of two requests decoding side by side slow both down
    two = dataclasses.replace(CONFIG, replicas=2, dropping=False, cores=2, client_token_ms=1.0)
    requests = [SimRequest(0.0, 16, 48), SimRequest(0.0, 16, 48)]
    free = simulate(two, requests)
    loaded = simulate(dataclasses.replace(two, token_cpu_ms=30.0), requests)
    assert np.all(loaded.tbt_s > free.tbt_s * 1.05)
    apart = dataclasses.replace(two, cores=None)  # a processor each: nothing to share
    assert np.array_equal(simulate(dataclasses.replace(apart, token_cpu_ms=30.0), requests).tbt_s,
                          simulate(apart, requests).tbt_s)
    with pytest.raises(ValueError, match="token_cpu_ms"):
        dataclasses.replace(CONFIG, token_cpu_ms=-1.0)


def test_the_clients_own_work_queues_its_tokens_and_the_tokens_of_one_iteration_share_a_head_pass() -> None:
    lone_replica = dataclasses.replace(CONFIG, replicas=1, dropping=False)
    # the short prompt's prefill joins the long one's last chunk: both first tokens come out of one iteration, and
    # from then on both requests decode in the same iterations
    both = [SimRequest(0.0, 300, 48), SimRequest(0.0, 16, 48)]
    free = simulate(lone_replica, both)
    assert free.ttft_s[1] == pytest.approx(free.ttft_s[0])
    # 100 ms of the client's work a token: a round's two tokens take 200 ms before they go on
    per_token = simulate(dataclasses.replace(lone_replica, client_token_ms=100.0), both)
    assert per_token.ttft_s - free.ttft_s == pytest.approx([0.2, 0.2])
    assert (per_token.tbt_s >= 0.2 - 1e-9).all()
    # 100 ms a head pass: the round's two tokens share it
    shared = simulate(dataclasses.replace(lone_replica, client_pass_ms=100.0), both)
    assert shared.ttft_s - free.ttft_s == pytest.approx([0.1, 0.1])
    assert (shared.tbt_s >= 0.1 - 1e-9).all() and (shared.tbt_s < 0.2 - 1e-9).all()
    # a request alone: its token waits for the pass ahead of it
    staggered = simulate(dataclasses.replace(lone_replica, client_pass_ms=100.0),
                         [SimRequest(0.0, 16, 48), SimRequest(0.0, 16, 48)])
    assert staggered.ttft_s[1] - staggered.ttft_s[0] == pytest.approx(0.1)


def test_a_head_pass_waits_for_the_decode_steps_of_its_unit_still_on_their_way_and_they_go_on_in_step() -> None:
    # two requests on one replica, the second arriving while the first's prompt computes: apart, each token takes
    # its own 100-ms pass, so their iterations stay staggered; waiting for each other, they share one pass a token
    lone_replica = dataclasses.replace(CONFIG, replicas=1, dropping=False, client_pass_ms=100.0, round_trip_ms=20.0)
    requests = [SimRequest(0.0, 16, 24), SimRequest(0.005, 16, 24)]
    apart = simulate(lone_replica, requests)
    ganged = simulate(dataclasses.replace(lone_replica, client_gang_wait_s=0.5), requests)
    assert (ganged.tbt_s < apart.tbt_s - 0.05).all()  # a pass a token for both, not one each
    # the second's first token waits for the first's decode step on its way, but never longer than the wait
    assert ganged.ttft_s[1] > apart.ttft_s[1]
    capped = simulate(dataclasses.replace(lone_replica, client_gang_wait_s=0.001), requests)
    assert capped.ttft_s[1] <= apart.ttft_s[1] + 0.001 + 1e-9
    # a request alone never waits: the wait changes nothing
    alone = [SimRequest(0.0, 16, 24)]
    assert np.array_equal(simulate(dataclasses.replace(lone_replica, client_gang_wait_s=0.5), alone).tbt_s,
                          simulate(lone_replica, alone).tbt_s)
    with pytest.raises(ValueError, match="client_gang_wait_s"):
        dataclasses.replace(lone_replica, client_gang_wait_s=-1.0)


def test_a_prompts_hidden_states_cross_the_clients_link_once_to_a_replica_and_thrice_through_a_pair() -> None:
    # 1000 bytes a token, 1 MB/s each way: a 16-token prompt takes 16 ms a crossing
    link = {"client_link_bytes_per_s": 1e6, "hidden_bytes_per_token": 1000}
    crossing_s = 16 * 1000 / 1e6
    calm = [SimRequest(1.0 * i, 16, 48) for i in range(10)]
    for groups, crossings in ((1, 1), (2, 3)):  # up to the replica; up, down from the first member, up to the next
        config = dataclasses.replace(CONFIG, dropping=False, static_groups=groups, member_batching=True)
        free, limited = simulate(config, calm), simulate(dataclasses.replace(config, **link), calm)
        assert limited.ttft_s - free.ttft_s == pytest.approx(np.full(10, crossings * crossing_s))
        assert np.allclose(limited.tbt_s, free.tbt_s)  # a decode step's hidden state queues behind no prompt
    # prompts that arrive together cross one after another: the second's waits for the first's
    together = [SimRequest(0.0, 16, 4), SimRequest(0.0, 16, 4)]
    config = dataclasses.replace(CONFIG, dropping=False, replicas=2)
    free, limited = simulate(config, together), simulate(dataclasses.replace(config, **link), together)
    assert sorted(limited.ttft_s - free.ttft_s) == pytest.approx([crossing_s, 2 * crossing_s])


def test_a_prompt_message_takes_its_measured_extra_beyond_its_bytes_without_holding_the_link() -> None:
    # 1000 bytes a token, 1 MB/s: a 16-token prompt's 16 kB cross in 16 ms, and a message of 16 kB waits 10 ms more;
    # a 32 kB one 30 ms (the last point holds beyond it)
    link = {"client_link_bytes_per_s": 1e6, "hidden_bytes_per_token": 1000}
    extra = {"client_link_extra_s": ((16_000, 0.010), (32_000, 0.030))}
    calm = [SimRequest(1.0 * i, 16, 48) for i in range(10)]
    for groups, crossings in ((1, 1), (2, 3)):
        config = dataclasses.replace(CONFIG, dropping=False, static_groups=groups, member_batching=True, **link)
        plain, waited = simulate(config, calm), simulate(dataclasses.replace(config, **extra), calm)
        assert waited.ttft_s - plain.ttft_s == pytest.approx(np.full(10, crossings * 0.010))
    # two prompts together: the second's bytes follow the first's, but not its extra
    together = [SimRequest(0.0, 16, 4), SimRequest(0.0, 16, 4)]
    config = dataclasses.replace(CONFIG, dropping=False, replicas=2, **link)
    plain, waited = simulate(config, together), simulate(dataclasses.replace(config, **extra), together)
    assert sorted(waited.ttft_s - plain.ttft_s) == pytest.approx([0.010, 0.010])
    assert link_extra_s(extra["client_link_extra_s"], 8_000) == pytest.approx(0.005)
    assert link_extra_s(extra["client_link_extra_s"], 24_000) == pytest.approx(0.020)
    assert link_extra_s(extra["client_link_extra_s"], 64_000) == pytest.approx(0.030)
    assert link_extra_s((), 64_000) == 0.0
    with pytest.raises(ValueError, match="client_link_extra_s"):
        dataclasses.replace(config, client_link_extra_s=((32_000, 0.03), (16_000, 0.01)))


def test_decode_steps_join_a_prompt_chunk_computing_on_their_member_and_end_with_it() -> None:
    # one replica: a request decoding, its steps 15 ms away between tokens, then a 1000-token prompt (four
    # 256-token chunks of 12.8 ms + 10 ms each), whose chunks compute while the decode steps are away
    lone_replica = dataclasses.replace(CONFIG, replicas=1, dropping=False, tokens_per_page=256, round_trip_ms=15.0)
    requests = [SimRequest(0.0, 16, 64), SimRequest(0.1, 1000, 4)]
    waiting = simulate(lone_replica, requests)
    joining = simulate(dataclasses.replace(lone_replica, join_prefill=True), requests)
    # a step that waited for each chunk now rides along: the decoding request's tokens come sooner
    assert joining.tbt_s[0] < waiting.tbt_s[0]
    # and the chunks wait while it catches up through what they have done: the prompt's first token comes later
    assert joining.ttft_s[1] > waiting.ttft_s[1]
    # with no prompt beside it, joining changes nothing
    alone = [SimRequest(0.0, 16, 64)]
    assert np.array_equal(simulate(dataclasses.replace(lone_replica, join_prefill=True), alone).tbt_s,
                          simulate(lone_replica, alone).tbt_s)


def test_decode_steps_pass_a_prompt_chunk_computing_on_their_member_and_it_waits_for_them() -> None:
    # the set-up above with chunks 4x as costly (51.2 + 10 ms): the rest of a chunk after its first block holds a
    # decode step more than twice its own 10.1 ms
    lone_replica = dataclasses.replace(CONFIG, replicas=1, dropping=False, tokens_per_page=256, round_trip_ms=15.0,
                                       prefill_token_ms=0.2)
    requests = [SimRequest(0.0, 16, 64), SimRequest(0.1, 1000, 4)]
    waiting = simulate(lone_replica, requests)
    joining = simulate(dataclasses.replace(lone_replica, join_prefill=True), requests)
    passing = simulate(dataclasses.replace(lone_replica, overtake_prefill=True), requests)
    # a step that joins a chunk ends with it; one that passes it ends after its own compute
    assert passing.tbt_s[0] < joining.tbt_s[0] < waiting.tbt_s[0]
    # the chunks wait for the steps that pass them, as for those that join them
    assert passing.ttft_s[1] > waiting.ttft_s[1]
    # steps that would gain too little against what their batch holds the chunk up ride it instead
    never = simulate(dataclasses.replace(lone_replica, overtake_prefill=True, overtake_gain=1e9), requests)
    assert np.array_equal(never.tbt_s, joining.tbt_s) and np.array_equal(never.ttft_s, joining.ttft_s)
    # with no prompt beside it, passing changes nothing
    alone = [SimRequest(0.0, 16, 64)]
    assert np.array_equal(simulate(dataclasses.replace(lone_replica, overtake_prefill=True), alone).tbt_s,
                          simulate(lone_replica, alone).tbt_s)
    # a pipeline's members do the same, each for its slice: every request is served
    pair = dataclasses.replace(lone_replica, replicas=2, static_groups=2, member_batching=True, overtake_prefill=True)
    crowd = [SimRequest(0.05 * i, 300 if i % 2 else 16, 24) for i in range(12)]
    assert np.isfinite(simulate(pair, crowd).tbt_s).all()


def test_a_gang_of_decode_steps_passes_a_chunk_whose_rest_would_hold_them_twice_a_lone_steps_time() -> None:
    """As the servers' `StepScheduler._passes`: the rest of the chunk against the gain x a lone step's time (not the
    gang's whole batch), and not before the chunk's first block is done."""
    config = dataclasses.replace(CONFIG, replicas=1, dropping=False, overtake_prefill=True, decode_token_ms=5.0)

    def arrive_at(now_s: float) -> tuple[_Sim, _Batch]:
        sim = _Sim(config, [], horizon_s=1.0)
        unit = next(iter(sim.units.values()))
        chunk = _Batch(unit.uid, 0, True, [(_Running(0, SimRequest(0.0, 512, 4), 8), 256)], started_s=0.0,
                       end_s=0.1, prefill=True)  # 8 blocks in 100 ms: its first block is done at 12.5 ms
        sim.computing[0], sim.now = chunk, now_s
        gang = [_Running(1 + i, SimRequest(0.0, 1, 8), 8, prefilled=1) for i in range(10)]  # decoding
        sim._overtake(chunk, gang, 1.0, 1, True)
        return sim, chunk

    # a lone step takes 10 + 5 ms, the gang's batch 10 + 10 x 5: 80 ms of chunk left hold them more than 2 x 15
    # (the old rule, 2 x 60, had them ride it)
    sim, chunk = arrive_at(0.02)
    passing = [batch for *_, batch in sim.events if batch is not None and batch.passing]
    assert chunk.passed and len(passing) == 1 and len(passing[0].items) == 10
    assert passing[0].end_s == pytest.approx(0.08) and chunk.end_s == pytest.approx(0.16)  # it waits for their 60 ms
    # 25 ms left: less than twice a lone step's time, they ride it; before its first block is done, too
    for now_s in (0.075, 0.01):
        sim, chunk = arrive_at(now_s)
        assert not chunk.passed and len(chunk.items) == 11
        assert not [batch for *_, batch in sim.events if batch is not None and batch.passing]


def test_with_work_noise_each_batch_takes_its_own_draw_the_same_for_a_seed_and_about_its_work_on_average() -> None:
    lone = dataclasses.replace(CONFIG, replicas=1, dropping=False)
    requests = [SimRequest(0.2 * i, 200, 30) for i in range(40)]
    plain = simulate(lone, requests)
    assert np.array_equal(simulate(dataclasses.replace(lone, work_noise=0.0), requests).ttft_s, plain.ttft_s)
    noisy = dataclasses.replace(lone, work_noise=0.3)
    once, again = simulate(noisy, requests), simulate(noisy, requests)
    assert np.array_equal(once.ttft_s, again.ttft_s) and np.array_equal(once.tbt_s, again.tbt_s)
    other = simulate(dataclasses.replace(noisy, placement_seed=1), requests)
    assert not np.array_equal(once.tbt_s, other.tbt_s)
    assert not np.array_equal(once.tbt_s, plain.tbt_s)
    # the factor's mean is 1: 40 requests' 29 gaps each, their mean within a few percent of the plain run's
    assert np.nanmean(once.tbt_s) == pytest.approx(np.nanmean(plain.tbt_s), rel=0.05)
    sim = _Sim(noisy, [], horizon_s=1.0)
    draws = np.array([sim._noisy(100.0) for _ in range(4000)])
    assert draws.mean() == pytest.approx(100.0, rel=0.03) and np.log(draws).std() == pytest.approx(0.3, rel=0.05)
    with pytest.raises(ValueError, match="work_noise"):
        dataclasses.replace(lone, work_noise=-0.1)


def test_with_decode_rows_reserved_a_prompt_chunk_leaves_a_token_for_every_other_request_of_its_unit() -> None:
    # one replica, batches of 64 tokens: a prompt of 64 alone computes in one batch of 13.2 ms...
    lone = dataclasses.replace(CONFIG, replicas=1, dropping=False, prefill_chunk_tokens=64)
    reserving = dataclasses.replace(lone, reserve_decode_rows=True)
    assert simulate(lone, [SimRequest(0.0, 64, 2)]).ttft_s[0] == pytest.approx(0.0132)
    # ...but as a swarm server forms its batches it leaves a token for its own session's row: 63, then 1
    assert simulate(reserving, [SimRequest(0.0, 64, 2)]).ttft_s[0] == pytest.approx(0.0132 - 0.00005 + 0.01005)
    assert simulate(reserving, [SimRequest(0.0, 63, 2)]).ttft_s[0] == simulate(lone, [SimRequest(0.0, 63, 2)]).ttft_s[0]
    # three requests decoding, their steps 15 ms away between tokens, then a prompt of 62: it leaves their three
    # rows and its own, so it needs a budget of 66 to compute in one batch
    away = dataclasses.replace(lone, round_trip_ms=15.0)
    requests = [SimRequest(0.0, 16, 40)] * 3 + [SimRequest(0.1, 62, 2)]
    def first_token(chunk: int, reserve: bool) -> float:
        config = dataclasses.replace(away, prefill_chunk_tokens=chunk, reserve_decode_rows=reserve)
        return float(simulate(config, requests).ttft_s[3])
    assert first_token(65, True) > first_token(65, False) + 0.005
    assert first_token(66, True) == first_token(66, False)


def test_a_request_holds_its_pages_until_its_client_has_closed_it() -> None:
    # one replica with room for one request of 32 pages at a time; a token's round trip to the client is 100 ms
    config = dataclasses.replace(CONFIG, replicas=1, dropping=False, round_trip_ms=100.0)
    result = simulate(config, [SimRequest(0.0, 200, 4), SimRequest(0.0, 200, 4)])
    # the first: its prompt computes by 0.020 s and each of its 3 decode steps (10.1 ms) waits for the token before;
    # its last step ends at 0.3503, the client sees that token at 0.4503 and its close reaches the server at 0.5003
    assert result.ttft_s[0] == pytest.approx(0.120)
    # only then does the second take the pages: its prompt computes by 0.5203, the client sees its first token 0.1 s on
    assert result.ttft_s[1] == pytest.approx(0.6203)


def test_a_clients_try_takes_its_time_before_it_is_admitted_or_backs_off() -> None:
    # one replica with room for one request of 32 pages at a time; clients back off 0.5 s, doubling, when refused
    config = dataclasses.replace(CONFIG, replicas=1, dropping=False, retry_backoff_s=(0.5, 4.0))
    requests = [SimRequest(0.0, 200, 4), SimRequest(0.0, 200, 4)]
    instant = simulate(config, requests)
    # the first computes its prompt by 0.020 s and closes at 0.0503; the second, refused at 0, tries again at 0.5
    assert instant.ttft_s == pytest.approx([0.020, 0.520])
    slow = simulate(dataclasses.replace(config, lookup_s=0.2), requests)  # every try looks the DHT up (no record age)
    # each try is decided 0.2 s after it began: the first is admitted at 0.2; the second is refused then, backs off
    # from 0.2 to 0.7 and is admitted at 0.9
    assert slow.ttft_s == pytest.approx([0.220, 0.920])
    with pytest.raises(ValueError, match="lookup_s"):
        dataclasses.replace(config, lookup_s=-0.1)


def test_a_clients_try_looks_the_dht_up_when_no_records_are_fresh_and_opens_every_member() -> None:
    # the live client's figures: a DHT lookup of 0.2 s unless one that began within 1 s has ended, then an `open`
    # call of 0.03 s on each member of its chain; one replica with room for one request of 32 pages at a time
    config = dataclasses.replace(CONFIG, replicas=1, dropping=False, retry_backoff_s=(0.5, 4.0), lookup_s=0.2,
                                 records_max_age_s=1.0, open_s=0.03)
    spaced = simulate(config, [SimRequest(0.0, 200, 4), SimRequest(0.5, 200, 4), SimRequest(2.0, 200, 4)])
    # the first looks up (0.2 s) and opens (0.03 s) before its prompt computes in 0.020 s; the second routes on the
    # first's records, half a second old; the third's are two seconds old: it looks up again
    assert spaced.ttft_s == pytest.approx([0.250, 0.050, 0.250])
    # the second arrives while the first's lookup runs: it looks up on its own, is refused at 0.2 (the first took
    # the room), calls `open` on the one replica, backs off from 0.23 to 0.73 and looks up afresh, as a live client
    # does after a backoff whatever records it has (0.2 s)
    together = simulate(config, [SimRequest(0.0, 200, 4), SimRequest(0.0, 200, 4)])
    assert together.ttft_s == pytest.approx([0.250, 0.980])
    # through a group of two members, a try opens both, one after the other
    pair = dataclasses.replace(CONFIG, replicas=2, static_groups=2, dropping=False, retry_backoff_s=(0.5, 4.0))
    lone = [SimRequest(0.0, 200, 4)]
    opened = simulate(dataclasses.replace(pair, lookup_s=0.2, records_max_age_s=1.0, open_s=0.03), lone)
    assert opened.ttft_s[0] - simulate(pair, lone).ttft_s[0] == pytest.approx(0.26)
    with pytest.raises(ValueError, match="open_s"):
        dataclasses.replace(config, open_s=-0.01)


def test_live_exchange_keeps_a_victim_computing_while_its_kv_follows() -> None:
    pair = dataclasses.replace(CONFIG, replicas=2, link_bytes_per_s=1e6)
    exchange_s = 26 * 4 * 1536 / 1e6  # 26 tokens of KV for the 4 blocks its member dropped, over 1 MB/s
    for live, members in itertools.product((False, True), (False, True)):
        sim = _Sim(dataclasses.replace(pair, live_exchange=live, member_batching=members), [SimRequest(0.0, 16, 48)],
                   horizon_s=10.0)
        victim = _Running(0, sim.requests[0], 8, prefilled=16, produced=10)
        next(iter(sim.units.values())).running.append(victim)
        sim._drop(required=1)
        (group,) = sim.units.values()
        assert group.members == (0, 1) and group.running == [victim]
        events = [(kind, when) for when, _, kind, _, _ in sim.events]
        if live and members:  # no stall: it computes at once on the first member, its batch one round trip (2
            # hops) longer per remote block of that member's half of the blocks
            assert sim.stalls == [0.0] and victim.remote_until_s == pytest.approx(exchange_s)
            assert events == [("step", pytest.approx(((10.0 + 0.1) / 2 + 2 * 4 / 2 * 1.0) / 1000))]
        elif live:  # a micro-batch crosses both members: one hop, and a round trip per remote block
            assert sim.stalls == [0.0] and victim.remote_until_s == pytest.approx(exchange_s)
            assert events == [("step", pytest.approx((10.0 + 0.1 + (1 + 2 * 4) * 1.0) / 1000))]
        else:  # blocking: it waits for its KV
            assert sim.stalls == [pytest.approx(exchange_s)] and events == [("wake", pytest.approx(exchange_s))]


@pytest.mark.parametrize("follow_ms", [None, 50.0])
def test_a_prompt_a_drop_catches_starts_over_after_its_batch_and_its_clients_follow_as_the_servers_stop_it(
    follow_ms: float | None,
) -> None:
    pair = dataclasses.replace(CONFIG, replicas=2, stopped_prompt_follow_ms=follow_ms, prefill_chunk_tokens=32)
    sim = _Sim(pair, [SimRequest(0.0, 64, 16)] * 3, horizon_s=10.0)
    unit = next(iter(sim.units.values()))
    computing = _Running(0, sim.requests[0], 8, prefilled=32)  # half its prompt done, the next chunk computing
    queued = _Running(1, sim.requests[1], 8, prefilled=32)  # half done, its next chunk waiting for the budget
    decoding = _Running(2, sim.requests[2], 8, prefilled=64, produced=3, ready_s=1.0)
    unit.running += [computing, queued, decoding]
    sim._start(unit)
    (batch,) = sim.computing.values()
    assert [running for running, _ in batch.items] == [computing] and not queued.in_flight
    sim._drop(required=1)
    assert len(sim.units) == 1 and decoding.prefilled == 64 and decoding.produced == 3
    # victims smallest first, by index: a stopped prompt's session moves with no KV, so nothing of it stalls
    assert (sim.stalls[0] > 0, sim.stalls[1] > 0, sim.stalls[2] > 0) == (follow_ms is None, follow_ms is None, True)
    sim.now = batch.end_s
    sim._finish_step(batch)
    if follow_ms is None:  # each keeps what its replica computed and goes on through the pair
        assert (computing.prefilled, queued.prefilled) == (64, 32) and computing.produced == 1
        return
    # the servers stopped both prompts and answered what they had computed of them with nothing: their clients
    # send them again, whole, a follow after the drop (the one queued) or after its batch ended (the one computing)
    assert (computing.prefilled, queued.prefilled) == (0, 0) and computing.produced == 0
    assert queued.ready_s >= follow_ms / 1000 and computing.ready_s >= batch.end_s + follow_ms / 1000
    assert not computing.stopped and (computing.stage, computing.pass_done) == (0, 0)


def test_with_the_exchange_transient_a_victims_moved_kv_holds_pages_twice_until_it_has_crossed() -> None:
    pair = dataclasses.replace(CONFIG, replicas=2, link_bytes_per_s=1e6)
    exchange_s = 26 * 4 * 1536 / 1e6  # 26 tokens of KV for the 4 blocks its member dropped, over 1 MB/s
    for transient, live in itertools.product((False, True), (False, True)):
        sim = _Sim(dataclasses.replace(pair, exchange_transient=transient, live_exchange=live),
                   [SimRequest(0.0, 16, 48), SimRequest(0.0, 16, 48)], horizon_s=10.0)
        victim = _Running(0, sim.requests[0], 8, prefilled=16, produced=10)
        next(iter(sim.units.values())).running.append(victim)
        sim._drop(required=1)
        (group,) = sim.units.values()
        assert group.capacity == 2 * 100 - 40
        if not transient:  # the drop's pages are free at once
            assert group.held == 8 and group.copies == []
            continue
        # its KV for the 4 dropped blocks (half of its 8 pages) is on both members until it has crossed, blocking or
        # live alike; then those pages come free, and the requests waiting are served
        assert group.held == 8 + 4 and group.copies == [(pytest.approx(exchange_s), 4)]
        assert ("copied", pytest.approx(exchange_s)) in [(kind, when) for when, _, kind, _, _ in sim.events]
        sim.now = exchange_s
        sim._copied(group.uid)
        assert group.held == 8 and group.copies == []
    # a merge while a pair's exchange still crosses carries its copies into the group of four, freed on time there
    sim = _Sim(dataclasses.replace(CONFIG, exchange_transient=True), [], horizon_s=1.0)
    sim.units = {}
    sim._add_unit((0, 1)).copies.append((0.5, 4))
    sim._add_unit((2, 3))
    sim.kept.update({0: (0, 4), 1: (4, 8), 2: (0, 4), 3: (4, 8)})
    sim._drop(1)
    (merged,) = sim.units.values()
    assert merged.copies == [(0.5, 4)] and ("copied", merged.uid) in [(e[2], e[3]) for e in sim.events]
    sim.now = 0.5
    sim._copied(merged.uid)
    assert merged.copies == [] and merged.held == 0


def test_merging_two_pairs_moves_each_victims_kv_for_the_blocks_its_members_no_longer_keep_in_parallel() -> None:
    sim = _Sim(CONFIG, [], horizon_s=1.0)
    sim.units = {}
    first, second = sim._add_unit((0, 1)), sim._add_unit((2, 3))
    sim.kept.update({0: (0, 4), 1: (4, 8), 2: (0, 4), 3: (4, 8)})
    victim = _Running(0, SimRequest(0.0, 64, 16), 8, prefilled=64)
    first.running.append(victim)
    second.running.append(_Running(1, SimRequest(0.0, 16, 16), 8, prefilled=16))
    sim._drop(1)
    (merged,) = sim.units.values()
    assert merged.members == (0, 2, 1, 3) and merged.capacity == 4 * 100 - 40
    assert sim.kept == {0: (0, 2), 2: (2, 4), 1: (4, 6), 3: (6, 8)}  # each keeps half of its slice
    # members 0 and 1 each send 2 blocks of the victim's 64 tokens at once: the stall is one member's share
    assert victim.ready_s == pytest.approx(64 * 2 * CONFIG.kv_bytes_per_token_block / CONFIG.link_bytes_per_s)
    assert sim.largest_group == 4 and sim.drops == 1


def test_a_step_ready_soon_does_not_wait_for_a_stalled_victims_later_wake() -> None:
    # one replica: a victim whose KV arrives at 5 s, and a request whose steps each wait for a 100-ms round trip
    config = dataclasses.replace(CONFIG, replicas=1, dropping=False, round_trip_ms=100.0)
    sim = _Sim(config, [SimRequest(0.0, 16, 4), SimRequest(100.0, 16, 4)], horizon_s=10.0)
    (unit,) = sim.units.values()
    unit.running.append(_Running(1, sim.requests[1], 8, prefilled=16, produced=1, first_token_s=0.0, ready_s=5.0))
    result = sim.run()
    # each of its steps starts when its token's round trip ends, not when the victim wakes
    assert result.ttft_s[0] < 0.2 and result.tbt_s[0] < 0.2
    assert result.tbt_s[1] > 5.0 / 3  # the victim's three tokens came after 5 s


def test_a_refused_client_asks_again_when_the_unit_names_its_room_if_sooner_than_its_backoff() -> None:
    # one replica with room for one request of 48 pages at a time: the first decodes 170 tokens at about 10 ms each
    config = dataclasses.replace(CONFIG, replicas=1, dropping=False, retry_backoff_s=(0.5, 4.0))
    requests = [SimRequest(0.0, 200, 170), SimRequest(0.0, 200, 4)]
    plain = simulate(config, requests)
    first_end_s = plain.ttft_s[0] + 169 * plain.tbt_s[0]
    assert 1.5 < first_end_s < 3.5
    # refused at 0 (no interval known yet), 0.5 and 1.5 s: its backoff has it back at 3.5 s
    assert plain.ttft_s[1] > 3.5
    hinted = simulate(dataclasses.replace(config, retry_hint=True), requests)
    assert hinted.ttft_s[0] == pytest.approx(plain.ttft_s[0])
    # at 0.5 s the replica names the first's end: the second asks again then (at most one more short wait)
    assert first_end_s < hinted.ttft_s[1] < first_end_s + 0.1


def test_a_unit_keeps_the_room_it_named_for_an_earlier_wait_from_a_later_arrival() -> None:
    # one replica with room for one request at a time, a DHT lookup of 0.3 s before every try: the first decodes
    # until about 2.03 s; the second, refused from 0.2 s on, is named that end and comes back after its lookup
    config = dataclasses.replace(CONFIG, replicas=1, dropping=False, retry_backoff_s=(0.5, 4.0), lookup_s=0.3,
                                 retry_hint=True, keep_named=True)
    end_s = 2.0269
    for later_s in (end_s - 0.25, end_s - 0.1):  # the third's first try comes between the room and the second's
        requests = [SimRequest(0.0, 200, 170), SimRequest(0.2, 200, 170), SimRequest(later_s, 200, 170)]
        result = simulate(config, requests)
        first_end_s = result.ttft_s[0] + 169 * result.tbt_s[0]
        assert first_end_s == pytest.approx(end_s, abs=1e-3)
        second_s, third_s = (requests[i].arrival_s + result.ttft_s[i] for i in (1, 2))
        assert first_end_s < second_s < first_end_s + 0.5  # its named room was kept until it came
        assert third_s > second_s + 169 * result.tbt_s[1]  # the later arrival waits its turn
        unkept = simulate(dataclasses.replace(config, keep_named=False), requests)
        assert unkept.ttft_s[2] + requests[2].arrival_s < first_end_s + 0.5  # without the keep it takes the room


def test_a_wait_admitted_on_one_unit_is_withdrawn_from_the_others_so_their_kept_room_serves_the_next() -> None:
    # two replicas with room for one request each, both busy until about 1.8 s; the third, refused by both from
    # 0.2 s on, is named that end by both and opens on one of them after its 0.1 s lookup; the fourth comes after
    config = dataclasses.replace(CONFIG, replicas=2, dropping=False, retry_backoff_s=(0.5, 4.0), lookup_s=0.1,
                                 retry_hint=True, keep_named=True)
    requests = [SimRequest(0.0, 200, 170), SimRequest(0.01, 200, 170), SimRequest(0.2, 200, 170),
                SimRequest(2.0, 200, 170)]
    kept = simulate(config, requests)
    room_s = max(requests[i].arrival_s + kept.ttft_s[i] + 169 * kept.tbt_s[i] for i in (0, 1))
    assert 1.5 < room_s < 2.1
    assert requests[2].arrival_s + kept.ttft_s[2] < room_s + 0.5  # it came back at the named time
    # kept for the third until its grace ends, the other replica's room turns the fourth away: it backs off
    assert requests[3].arrival_s + kept.ttft_s[3] > room_s + NAMED_ROOM_GRACE_S
    withdrawn = simulate(dataclasses.replace(config, withdraw_waits=True), requests)
    assert withdrawn.ttft_s[2] == pytest.approx(kept.ttft_s[2])
    assert withdrawn.ttft_s[3] < 0.3  # the room is its own at its first try


def test_a_tokens_delay_grows_with_the_other_requests_decoding_up_to_the_cap() -> None:
    # four replicas, a request on each, decoding at once; no shared cores: only the delay differs
    config = dataclasses.replace(CONFIG, dropping=False)
    together = [SimRequest(0.0, 16, 200) for _ in range(4)]

    def tbt_ms(requests: list[SimRequest], **changes: float) -> float:
        return float(np.mean(simulate(dataclasses.replace(config, **changes), requests).tbt_s)) * 1000

    alone = tbt_ms(together[:1], round_trip_per_decoding_ms=5.0)
    assert alone == pytest.approx(tbt_ms(together[:1]))  # no one else decoding: the round trip alone
    assert tbt_ms(together, round_trip_per_decoding_ms=5.0) == pytest.approx(alone + 3 * 5.0, abs=0.1)
    assert tbt_ms(together, round_trip_per_decoding_ms=5.0, round_trip_crowd_cap=2) == pytest.approx(
        alone + 2 * 5.0, abs=0.1)


def test_latency_placement_lands_on_any_unit_with_room_at_random_and_repeats_with_its_seed() -> None:
    config = dataclasses.replace(CONFIG, replicas=2, dropping=False, placement="latency")
    pages = config.pages_of(SimRequest(0.0, 16, 48))

    def landings(seed: int) -> list[int]:
        sim = _Sim(dataclasses.replace(config, placement_seed=seed), [], 3600.0)
        return [unit.uid for unit in (sim._place(pages) for _ in range(40)) if unit is not None]

    assert set(landings(0)) == {0, 1} and landings(0) == landings(0) and landings(0) != landings(1)
    sim = _Sim(config, [], 3600.0)
    sim.units[0].running.extend(_Running(i, SimRequest(0.0, 16, 48), sim.units[0].free) for i in range(1))
    assert {sim._place(pages).uid for _ in range(20)} == {1}  # the other has no room
    fewest = _Sim(dataclasses.replace(CONFIG, dropping=False, placement="fewest_hops"), [], 3600.0)
    assert {fewest._place(pages).uid for _ in range(20)} == {0}  # the oldest, always
