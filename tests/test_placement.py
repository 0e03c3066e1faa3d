"""GBP-CR (Alg. 1): m_j(c), amortized times, the greedy stacking of chains, and optimality under equal memory."""

from __future__ import annotations

import math
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.placement import (
    amortized_time_ms,
    blocks_for_capacity,
    gbp_cr,
    gbp_cr_plan,
    greedy_order,
    service_time_ms,
)
from orchestrator.swarm_model import ModelSpec, ServerSpec, SwarmModel

BLOOM = ModelSpec(blocks=70, block_gb=1.32, cache_gb=0.11)


def fig2_swarm() -> SwarmModel:
    """Five servers, three blocks, s_m = 8 and s_c = 1 GB: at c = 5 each block costs 13 GB (worked out by hand)."""
    model = ModelSpec(blocks=3, block_gb=8.0, cache_gb=1.0)
    return SwarmModel(model, (
        ServerSpec("A", 26.0, 10.0, 10.0),
        ServerSpec("B", 31.0, 10.0, 10.0),
        ServerSpec("C", 18.0, 10.0, 20.0),
        ServerSpec("D", 18.0, 10.0, 20.0),
        ServerSpec("E", 18.0, 10.0, 20.0),
    ))


def test_blocks_for_capacity_reserves_c_slots_per_block() -> None:
    fast, slow = ServerSpec("fast", 40.0, 30.0, 109.0), ServerSpec("slow", 20.0, 30.0, 175.0)
    assert blocks_for_capacity(fast, BLOOM, 8) == 18  # 40 / (1.32 + 0.88) = 18.2
    assert blocks_for_capacity(slow, BLOOM, 8) == 9
    assert blocks_for_capacity(fast, BLOOM, 0) == 30  # parameters only: 40 / 1.32
    assert blocks_for_capacity(ServerSpec("huge", 1000.0, 1.0, 1.0), BLOOM, 1) == 70  # at most L
    assert blocks_for_capacity(slow, BLOOM, 200) == 0
    # an exact quotient must not floor one short through rounding: 26 / (8 + 5 * 1) = 2
    assert blocks_for_capacity(fig2_swarm().server("A"), fig2_swarm().model, 5) == 2


def test_service_and_amortized_times() -> None:
    fast = ServerSpec("fast", 40.0, 36.0, 109.0)
    assert service_time_ms(fast, BLOOM, 8) == 36.0 + 109.0 * 18
    assert amortized_time_ms(fast, BLOOM, 8) == (36.0 + 109.0 * 18) / 18
    assert amortized_time_ms(ServerSpec("tiny", 1.0, 1.0, 1.0), BLOOM, 1) == math.inf


def test_gbp_cr_stacks_fastest_servers_and_shifts_the_last_one_back() -> None:
    swarm = fig2_swarm()
    plan = gbp_cr_plan(swarm, 5, arrival_rate_per_ms=1.0, rho_bar=1.0)  # target never met: all servers used
    assert plan.placement.blocks == {"A": (1, 2), "B": (2, 2), "C": (1, 1), "D": (2, 1), "E": (3, 1)}
    assert [chain.servers for chain in plan.chains] == [("A", "B"), ("C", "D", "E")]
    assert [chain.service_time_ms for chain in plan.chains] == [60.0, 90.0]  # sum of t_j(c), as in Alg. 1
    assert not plan.target_met


def test_gbp_cr_stops_when_the_chains_reach_the_target_rate() -> None:
    swarm = fig2_swarm()
    # one chain of rate 1/60 per ms carries lambda / (rho_bar c) = 0.05 / (1 * 5) = 1/100
    placement = gbp_cr(swarm, 5, arrival_rate_per_ms=0.05, rho_bar=1.0)
    assert placement.blocks == {"A": (1, 2), "B": (2, 2), "C": (0, 0), "D": (0, 0), "E": (0, 0)}
    assert placement.hosting() == ["A", "B"]


def test_greedy_order_skips_servers_without_room_and_breaks_ties_by_given_order() -> None:
    swarm = SwarmModel(BLOOM, (
        ServerSpec("b", 20.0, 30.0, 175.0),
        ServerSpec("tiny", 1.0, 1.0, 1.0),
        ServerSpec("a", 20.0, 30.0, 175.0),
        ServerSpec("fast", 40.0, 30.0, 109.0),
    ))
    assert [server.name for server in greedy_order(swarm, 4)] == ["fast", "b", "a"]


@st.composite
def swarms(draw: st.DrawFn, *, equal_memory: bool, max_servers: int) -> SwarmModel:
    blocks = draw(st.integers(1, 8))
    model = ModelSpec(blocks, draw(st.sampled_from([1.0, 2.0, 1.5])), draw(st.sampled_from([0.25, 0.5, 1.0])))
    count = draw(st.integers(1, max_servers))
    memory = draw(st.integers(1, 24))
    servers = tuple(
        ServerSpec(
            f"s{index}",
            float(memory if equal_memory else draw(st.integers(1, 24))),
            float(draw(st.integers(0, 50))),
            float(draw(st.integers(1, 40))),
        )
        for index in range(count)
    )
    return SwarmModel(model, servers)


@settings(max_examples=60, deadline=None)
@given(swarms(equal_memory=False, max_servers=8), st.integers(1, 6), st.floats(0.0001, 0.5), st.floats(0.1, 1.0))
def test_gbp_cr_placement_is_valid_and_keeps_the_reserved_slots(
    swarm: SwarmModel, capacity: int, arrival_rate: float, rho_bar: float
) -> None:
    plan = gbp_cr_plan(swarm, capacity, arrival_rate, rho_bar)
    assert list(plan.placement.blocks) == [server.name for server in swarm.servers]
    for server in swarm.servers:
        first, count = plan.placement.blocks[server.name]
        if count == 0:
            continue
        assert count == blocks_for_capacity(server, swarm.model, capacity)
        assert 1 <= first and first + count - 1 <= swarm.model.blocks
        assert plan.placement.residual_slots(swarm, server.name) >= capacity * count
    for chain in plan.chains:  # each disjoint chain covers 1..L in order
        covered = 0
        for name in chain.servers:
            first, count = plan.placement.blocks[name]
            assert first <= covered + 1
            covered = first + count - 1
        assert covered == swarm.model.blocks
    assert plan == gbp_cr_plan(swarm, capacity, arrival_rate, rho_bar)


def set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Gives every partition of `items` into non-empty groups."""
    if not items:
        yield []
        return
    head, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[head], *partition]
        for index in range(len(partition)):
            yield [*partition[:index], [head, *partition[index]], *partition[index + 1:]]


def brute_force_chains(swarm: SwarmModel, capacity: int, arrival_rate: float, rho_bar: float) -> int | None:
    """Gives the optimum of (10): fewest disjoint server groups, each with sum m_j(c) >= L, whose rates
    sum_k 1 / sum_{j in S_k} t_j(c) reach lambda / (rho_bar c); None if no grouping does."""
    model = swarm.model
    order = {server.name: rank for rank, server in enumerate(greedy_order(swarm, capacity))}
    usable = [index for index, server in enumerate(swarm.servers) if server.name in order]
    target = arrival_rate / (rho_bar * capacity)
    best: int | None = None
    for partition in set_partitions(usable):
        rates = []
        for group in partition:
            members = sorted((swarm.servers[index] for index in group), key=lambda server: order[server.name])
            if sum(blocks_for_capacity(server, model, capacity) for server in members) >= model.blocks:
                total_ms = 0.0
                for server in members:  # summed in GBP-CR's order, so equal groups give equal floats
                    total_ms += service_time_ms(server, model, capacity)
                rates.append(1.0 / total_ms)
        rates.sort(reverse=True)
        reached = 0.0
        for count, rate in enumerate(rates, start=1):
            reached += rate
            if reached >= target:
                if best is None or count < best:
                    best = count
                break
    return best


@settings(max_examples=150, deadline=None)
@given(swarms(equal_memory=True, max_servers=7), st.integers(1, 4), st.floats(0.05, 4.0), st.floats(0.1, 1.0))
def test_gbp_cr_matches_brute_force_when_memory_is_equal(
    swarm: SwarmModel, capacity: int, load: float, rho_bar: float
) -> None:
    """Theorem 3.4: with equal M_j, GBP-CR's number of chains is the optimum of (10) (and infeasible alike)."""
    # scale lambda to the fastest chain's rate, so that instances need 0, 1, 2 or more chains
    first = gbp_cr_plan(swarm, capacity, 1e-12, 1.0).chains
    arrival_rate = load * rho_bar * capacity / first[0].service_time_ms if first else load
    plan = gbp_cr_plan(swarm, capacity, arrival_rate, rho_bar)
    greedy = len(plan.chains) if plan.target_met else None
    assert greedy == brute_force_chains(swarm, capacity, arrival_rate, rho_bar)
