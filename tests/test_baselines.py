"""Baselines: capacities are never exceeded, placements follow their rules, routing and dispatch pick what they say."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.baselines.bprr import cgbp_placement
from orchestrator.baselines.helix import helix
from orchestrator.baselines.load_balancing import DedicatedQueues
from orchestrator.baselines.parallax import greedy_pipelines, parallax, parallax_layout, water_fill
from orchestrator.baselines.path_routing import PlacementGraph
from orchestrator.baselines.petals import (
    PetalsRetry,
    PetalsRouting,
    choose_best_start,
    petals_link_estimate_ms,
    petals_placement,
)
from orchestrator.dispatch_policy import NoFeasiblePlan
from orchestrator.sim.engine import simulate
from orchestrator.sim.methods import POLICIES, build_policy
from orchestrator.sim.presets import paper_swarm, synthetic_rtt
from orchestrator.sim.workload import Workload, poisson_workload
from orchestrator.swarm_model import Chain, ModelSpec, Placement, ServerSpec, SwarmModel


@st.composite
def small_swarms(draw) -> SwarmModel:
    blocks = draw(st.integers(2, 10))
    model = ModelSpec(blocks, block_gb=1.0, cache_gb=draw(st.sampled_from([0.1, 0.25, 0.5])))
    count = draw(st.integers(2, 7))
    servers = tuple(
        ServerSpec(
            f"s{i}",
            float(draw(st.integers(1, 2 * blocks))),
            float(draw(st.integers(0, 30))),
            float(draw(st.integers(5, 60))),
        )
        for i in range(count)
    )
    return SwarmModel(model, servers)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(swarm=small_swarms(), load=st.sampled_from([0.5, 2.0, 8.0]))
def test_no_policy_ever_holds_more_slots_than_a_server_has(swarm, load):
    """The engine raises CapacityViolation on any over-allocation; heavy load keeps every policy at its limits."""
    fastest = min(s.tau_p_ms for s in swarm.servers) * swarm.model.blocks
    rate = load / fastest
    workload = poisson_workload(rate, 150, np.random.default_rng(3))
    ran = 0
    for name in POLICIES:
        try:
            policy = build_policy(name, swarm, rate, 0.7, seed=1)
        except NoFeasiblePlan:
            continue
        result = simulate(policy, workload, swarm)
        assert np.all(result.start_ms >= result.arrivals_ms) and np.all(result.end_ms >= result.start_ms)
        assert all(0.0 <= u <= 1.0 + 1e-9 for u in result.server_utilization.values())
        assert all(0.0 <= c["utilization"] <= 1.0 + 1e-9 for c in result.chain_utilization)
        ran += 1
    total_gb = sum(s.memory_gb for s in swarm.servers)
    if total_gb >= 2 * swarm.model.blocks * (swarm.model.block_gb + swarm.model.cache_gb):
        assert ran > 0  # with memory for two model copies, some policy must be able to serve


def test_every_fig8_baseline_runs_on_the_paper_swarm_and_jffc_only_cannot():
    instance = paper_swarm(10, 0.2, seed=0, rtt=synthetic_rtt())
    for name in ("petals", "bprr", "parallax", "helix", "proposed"):
        assert build_policy(name, instance.swarm, 0.0002, 0.7, seed=0).placement.hosting()
    with pytest.raises(NoFeasiblePlan, match="whole model"):
        build_policy("jffc-only", instance.swarm, 0.0002, 0.7, seed=0)


def test_petals_picks_the_window_with_lexicographically_smallest_sorted_throughputs():
    assert choose_best_start([5.0, 1.0, 1.0, 0.0, 3.0], 2) == 3  # windows sorted: [1,5] [1,1] [0,1] [0,3]
    assert choose_best_start([0.0, 0.0, 0.0], 2) == 1  # ties go to the lowest start


def test_petals_reserves_two_sessions_of_cache_per_block():
    model = ModelSpec(70, 1.32, 0.11)
    swarm = SwarmModel(model, (ServerSpec("big", 40.0, 20.0, 109.0), ServerSpec("small", 20.0, 20.0, 175.0)))
    with pytest.raises(NoFeasiblePlan):  # 25 + 12 blocks cannot cover 70
        petals_placement(swarm, np.random.default_rng(0))
    swarm = SwarmModel(model, tuple(ServerSpec(f"b{i}", 40.0, 20.0, 109.0) for i in range(3)))
    counts = sorted(count for _, count in petals_placement(swarm, np.random.default_rng(0)).blocks.values())
    assert counts == [25, 25, 25]  # floor(40 / (1.32 + 2 * 0.11))


def test_petals_routes_by_its_own_estimate_rtt_half_plus_overhead():
    """Petals estimates a link as RTT / 2 + 18 ms + compute, not the relayed tau_c = RTT + 18 ms a hop costs."""
    assert petals_link_estimate_ms(78.0, 10.0, 2) == 30.0 + 18.0 + 20.0
    assert petals_link_estimate_ms(5.0, 10.0, 1) == 18.0 + 10.0  # tau_c below the overhead: RTT 0
    model = ModelSpec(2, 1.0, 0.1)
    # x: both blocks, RTT 60 (estimate 68, true 98); y1 + y2: one block each, RTT 20 (estimate 76, true 96)
    swarm = SwarmModel(model, (ServerSpec("x", 4.0, 78.0, 10.0), ServerSpec("y1", 4.0, 38.0, 10.0),
                               ServerSpec("y2", 4.0, 38.0, 10.0)))
    policy = PetalsRouting(swarm, Placement({"x": (1, 2), "y1": (1, 1), "y2": (2, 1)}))
    route = policy.choose(0, 0.0)
    assert route.servers == ("x",) and route.service_time_ms == 98.0  # the true time of its pick
    assert policy.graph.shortest_path(policy.base_cost)[0] == ("y1", "y2")  # what the true costs would pick
    policy.slots_free["x"] = 1  # x cannot hold the 2 slots the job needs now: the 10 s penalty moves it
    assert policy.choose(1, 0.0).servers == ("y1", "y2")


def test_petals_retry_backs_off_and_takes_freed_slots_only_when_it_asks_again():
    """As Petals' client: no room on the route, hold nothing, route again after 0.5 s, 1 s, 2 s, ..."""
    swarm = SwarmModel(ModelSpec(1, 1.0, 1.0), (ServerSpec("one", 2.0, 0.0, 1000.0),))  # 1 slot; a job takes 1 s
    policy = PetalsRetry(swarm, Placement({"one": (1, 1)}), backoff_ms=500.0, max_backoff_ms=8000.0)
    workload = Workload(np.zeros(3), np.ones(3), "three jobs at once")
    result = simulate(policy, workload, swarm)
    # job 0 runs 0-1000; job 1 finds no room at 0 and 500, takes the slot at 1500 (not at 1000, when it freed);
    # job 2 also tries at 500 and 1500 (job 1 was first), then 2 s later at 3500 (job 1 ended at 2500)
    assert result.start_ms.tolist() == [0.0, 1500.0, 3500.0]
    assert policy.waiting == 0


def test_petals_retry_routes_on_records_as_last_announced_and_backs_off_until_one_shows_the_server_full():
    """Two one-slot servers, records every 1 s (a at 0, 1000, ...; b at 500, 1500, ...): job 1 keeps picking the
    fast server its stale record shows free, until a's record of 1000 shows it full."""
    swarm = SwarmModel(ModelSpec(1, 1.0, 1.0), (ServerSpec("a", 2.0, 0.0, 2000.0), ServerSpec("b", 2.0, 0.0, 3000.0)))
    workload = Workload(np.array([0.0, 10.0]), np.ones(2), "two jobs")
    stale = PetalsRetry(swarm, Placement({"a": (1, 1), "b": (1, 1)}), record_period_ms=1000.0)
    result = simulate(stale, workload, swarm)
    assert result.start_ms.tolist() == [0.0, 1510.0]  # tried a at 10 and 510 (backoffs 500, 1000), then b
    fresh = simulate(PetalsRetry(swarm, Placement({"a": (1, 1), "b": (1, 1)})), workload, swarm)
    assert fresh.start_ms.tolist() == [0.0, 10.0]  # the true free slots: b at once
    with pytest.raises(ValueError, match="record_period_ms"):
        PetalsRetry(swarm, Placement({"a": (1, 1), "b": (1, 1)}), record_period_ms=-1.0)


def test_petals_servers_admit_each_job_by_its_own_kv_and_the_engine_counts_the_same():
    """A server of 2 slots (jobs of s_c): jobs of half and a quarter of s_c share it, one of a whole s_c waits."""
    swarm = SwarmModel(ModelSpec(1, 1.0, 1.0), (ServerSpec("one", 3.0, 0.0, 1000.0),))
    workload = Workload(np.zeros(4), np.ones(4), "four at once", np.array([0.5, 1.0, 0.25, 1.0]))
    policy = PetalsRetry(swarm, Placement({"one": (1, 1)}), job_units=workload.units)
    result = simulate(policy, workload, swarm)
    # 0.5 + 1.0 + 0.25 fit at once; the last whole job finds 0.25 free and backs off until job 0 and 2 ended
    assert result.start_ms.tolist() == [0.0, 0.0, 0.0, 1500.0]
    whole = Workload(np.zeros(4), np.ones(4), "four at once")  # the paper's reservation: two at a time
    result = simulate(PetalsRetry(swarm, Placement({"one": (1, 1)})), whole, swarm)
    assert result.start_ms.tolist() == [0.0, 0.0, 1500.0, 1500.0]
    with pytest.raises(ValueError, match="cache_units"):
        Workload(np.zeros(2), np.ones(2), "too big", np.array([0.5, 1.5]))


def test_cgbp_fills_under_served_blocks_before_balancing():
    model = ModelSpec(6, 1.0, 0.5)
    servers = tuple(ServerSpec(f"s{i}", 5.0, 1.0, 10.0 + i) for i in range(4))  # m_j = floor(5 / 2) = 2 at R = 2
    placement = cgbp_placement(SwarmModel(model, servers), 2)
    firsts = [placement.first_block(f"s{i}") for i in range(4)]
    # the three fastest cover the six blocks without overlap, the fourth goes where served counts are lowest
    assert sorted(firsts[:3]) == [1, 3, 5]
    assert all(placement.num_blocks(f"s{i}") == 2 for i in range(4))


def test_water_filling_splits_layers_by_speed_within_caps():
    assert water_fill([10, 10], [2.0, 1.0], 9) == [6, 3]
    assert water_fill([4, 10], [3.0, 1.0], 12) == [4, 8]
    counts = water_fill([7, 7, 7], [1.0, 1.0, 1.0], 20)
    assert sum(counts) == 20 and max(counts) <= 7


def test_parallax_pipelines_are_disjoint_and_each_holds_the_model():
    instance = paper_swarm(20, 0.2, seed=2, rtt=synthetic_rtt())
    pipelines = greedy_pipelines(instance.swarm)
    names = [s.name for p in pipelines for s in p]
    assert len(names) == len(set(names)) and len(pipelines) >= 2
    _, chains = parallax_layout(instance.swarm)
    for chain in chains:
        assert sum(chain.blocks_per_server) == 70 and chain.capacity >= 1
    assert parallax(instance.swarm).name == "parallax"


def test_helix_spreads_requests_in_proportion_to_flow():
    instance = paper_swarm(12, 0.25, seed=4, rtt=synthetic_rtt())
    policy = helix(instance.swarm)
    first_hops = [policy.choose(job, 0.0).servers[0] for job in range(400)]
    flows = dict(policy.weights[None])
    total = sum(flows.values())
    for name, flow in flows.items():
        assert first_hops.count(name) == pytest.approx(400 * flow / total, abs=1.5)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(swarm=small_swarms(), data=st.data())
def test_placement_graph_shortest_path_equals_brute_force(swarm, data):
    blocks = swarm.model.blocks
    placement = Placement({
        s.name: (first, min(data.draw(st.integers(1, blocks)), blocks - first + 1))
        for s in swarm.servers
        for first in [data.draw(st.integers(1, blocks))]
    })
    graph = PlacementGraph(swarm, placement)

    def cost(name: str, count: int) -> float:
        server = swarm.server(name)
        return server.tau_c_ms + server.tau_p_ms * count

    best = math.inf
    names = placement.hosting()
    for length in range(1, len(names) + 1):
        for path in itertools.permutations(names, length):
            route = graph.route(path)
            last, ok = 0, True
            for name in path:
                first, end = placement.first_block(name), graph.last_block[name]
                ok = ok and first <= last + 1 <= end
                last = end
            if ok and last == blocks:
                best = min(best, route.service_time_ms)
    found = graph.shortest_path(cost)
    if best == math.inf:
        assert found is None
    else:
        assert found is not None and found[1] == pytest.approx(best)
        assert graph.route(found[0]).service_time_ms == pytest.approx(best)


def _chains() -> tuple[Placement, list[Chain]]:
    placement = Placement({"a": (1, 1), "b": (1, 1), "c": (1, 1)})
    chains = [Chain(("a",), (1,), 2, 10.0), Chain(("b",), (1,), 1, 5.0), Chain(("c",), (1,), 1, 20.0)]
    return placement, chains


def test_sed_and_sa_jsq_prefer_the_fast_chain_and_jiq_an_idle_one():
    placement, chains = _chains()
    sed = DedicatedQueues(chains, placement, "sed", np.random.default_rng(0))
    assert sed.arrive(0, 0.0)[0].route.chain == 1  # 1/mu = 5 beats 10 and 20
    second = sed.arrive(1, 0.0)  # chain 1 is full: 5 + 1 * 5 = 10 ties chain 0's 10; chain 2 (20) never wins
    assert second == [] or second[0].route.chain == 0
    sa = DedicatedQueues(chains, placement, "sa-jsq", np.random.default_rng(0))
    assert [sa.arrive(j, 0.0)[0].route.chain for j in range(2)] == [1, 0]
    jiq = DedicatedQueues(chains, placement, "jiq", np.random.default_rng(0))
    picks = {jiq.arrive(j, 0.0)[0].route.chain for j in range(4)}
    assert picks == {0, 1, 2}  # four idle slots: every job found one
    assert jiq.arrive(4, 0.0) == []  # no idle chain: queued at a random chain
