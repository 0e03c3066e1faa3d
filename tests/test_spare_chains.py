"""Spare chains: GBP-CR keeps stacking the servers left over at its stop, and the paper-exact Alg. 1 is unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.allocation import gca, make_chain, slot_use
from orchestrator.analysis import exact_mean_response
from orchestrator.placement import DisjointChain, blocks_for_capacity, gbp_cr_plan
from orchestrator.sim.methods import build_policy, compose
from orchestrator.sim.presets import paper_swarm, synthetic_rtt
from orchestrator.swarm_model import Chain, SwarmModel
from orchestrator.tuning import overflow_estimate_ms, tune_capacity
from tests.test_allocation import check_gca_result
from tests.test_placement import fig2_swarm, swarms

PAPER_RATE = 0.2 / 1000.0  # the paper's 0.2 jobs/s, per ms


def test_spare_chains_by_hand_on_the_worked_example() -> None:
    swarm = fig2_swarm()
    # one chain (A, B) of rate 1/60 per ms carries 0.05 / (1 * 5): Alg. 1 stops there and C, D, E stay idle
    paper = gbp_cr_plan(swarm, 5, arrival_rate_per_ms=0.05, rho_bar=1.0)
    spare = gbp_cr_plan(swarm, 5, arrival_rate_per_ms=0.05, rho_bar=1.0, spare_chains=True)
    assert paper.placement.hosting() == ["A", "B"] and paper.spare == ()
    assert spare.chains == paper.chains and spare.target_met
    assert spare.spare == (DisjointChain(("C", "D", "E"), 90.0),)
    assert spare.placement.blocks == {"A": (1, 2), "B": (2, 2), "C": (1, 1), "D": (2, 1), "E": (3, 1)}
    # GCA over the whole placement: the worked example's three chains of capacity 5
    assert gca(swarm, spare.placement) == [
        Chain(("A", "B"), (2, 1), 5, 50.0),
        Chain(("C", "B"), (1, 2), 5, 60.0),
        Chain(("C", "D", "E"), (1, 1, 1), 5, 90.0),
    ]


@settings(max_examples=80, deadline=None, derandomize=True)
@given(swarms(equal_memory=False, max_servers=7), st.integers(1, 5), st.floats(0.0001, 0.5), st.floats(0.1, 1.0))
def test_spare_chains_extend_alg1_never_over_allocate_and_cover_every_block(
    swarm: SwarmModel, capacity: int, arrival_rate: float, rho_bar: float
) -> None:
    paper = gbp_cr_plan(swarm, capacity, arrival_rate, rho_bar)
    spare = gbp_cr_plan(swarm, capacity, arrival_rate, rho_bar, spare_chains=True)
    # Alg. 1 up to its stop is untouched: same chains, same verdict, same blocks for every server it placed
    assert spare.chains == paper.chains and spare.target_met == paper.target_met
    for name, (first, count) in paper.placement.blocks.items():
        if count:
            assert spare.placement.blocks[name] == (first, count)
    if not paper.target_met:
        assert spare == paper  # Alg. 1 used every server already: nothing is left to spare
    # no idle server that could host a block; each keeps c slots per hosted block
    for server in swarm.servers:
        first, count = spare.placement.blocks[server.name]
        assert count == blocks_for_capacity(server, swarm.model, capacity)
        if count:
            assert spare.placement.residual_slots(swarm, server.name) >= capacity * count
    # required and spare chains are disjoint, and each covers blocks 1..L in order
    members = [name for chain in (*spare.chains, *spare.spare) for name in chain.servers]
    assert len(members) == len(set(members))
    for chain in (*spare.chains, *spare.spare):
        made = make_chain(swarm, spare.placement, chain.servers, 1)  # raises unless the chain covers 1..L in order
        assert sum(made.blocks_per_server) == swarm.model.blocks
    # GCA over the whole placement is still Alg. 2: valid chains, fastest first, no server over-committed
    chains = gca(swarm, spare.placement)
    check_gca_result(swarm, spare.placement, chains)
    if spare.chains or spare.spare:
        assert chains  # every disjoint chain holds c jobs, so GCA finds at least one chain
    for use in slot_use(swarm, spare.placement, chains).values():
        assert 0 <= use.used <= use.total


def test_paper_exact_plan_on_a_fast_rich_swarm_is_unchanged_and_spare_chains_shorten_it() -> None:
    # J = 40, eta = 0.4: sixteen 40 GB servers. Alg. 1 with c = 8 stops after one chain of four fast servers
    # (18 blocks each); with spare chains c = 3 fits 24 blocks per fast server, so chains of three fast servers,
    # and the other fast servers form more of them instead of idling
    swarm = paper_swarm(40, 0.4, seed=0, rtt=synthetic_rtt()).swarm
    paper = tune_capacity(swarm, PAPER_RATE, 0.7)
    assert paper.c == 8 and not paper.spare_chains
    assert [(len(chain.servers), chain.blocks_per_server, chain.capacity) for chain in paper.chains] == [
        (4, (18, 18, 18, 16), 8)
    ]
    assert len(paper.placement.hosting()) == 4
    spare = tune_capacity(swarm, PAPER_RATE, 0.7, spare_chains=True, method="overflow")
    assert spare.c == 3 and spare.spare_chains
    assert len(spare.placement.hosting()) == 40
    three_fast = [chain for chain in spare.chains if len(chain.servers) == 3]
    assert len(three_fast) == 5 and all(chain.capacity == 3 for chain in three_fast)
    assert spare.chains[0].service_time_ms < paper.chains[0].service_time_ms
    assert spare.lower_ms < paper.lower_ms


def test_lower_bound_misranks_spare_chains_that_the_overflow_estimate_ranks_right() -> None:
    """With three fast servers, the lower bound picks c = 3 (one fast chain of 3 jobs, then slow spare chains);
    the exact JFFC steady state shows that is worse than Alg. 1's plan, and the overflow-tuned plan better."""
    swarm = paper_swarm(10, 0.3, seed=0, rtt=synthetic_rtt()).swarm
    paper = tune_capacity(swarm, PAPER_RATE, 0.7)
    by_bound = tune_capacity(swarm, PAPER_RATE, 0.7, spare_chains=True)
    by_overflow = tune_capacity(swarm, PAPER_RATE, 0.7, spare_chains=True, method="overflow")
    assert (paper.c, by_bound.c, by_overflow.c) == (5, 3, 4)

    def exact(chains: tuple[Chain, ...]) -> float:
        return exact_mean_response(PAPER_RATE, [c.rate_per_ms for c in chains], [c.capacity for c in chains])

    assert by_bound.lower_ms < by_overflow.lower_ms < paper.lower_ms  # what the bound believes
    assert exact(by_overflow.chains) < exact(paper.chains) < exact(by_bound.chains)  # what JFFC does
    for plan in (paper, by_bound, by_overflow):  # the estimate is within 0.5% of the exact value here
        assert overflow_estimate_ms(PAPER_RATE, plan.chains) == pytest.approx(exact(plan.chains), rel=5e-3)


def test_simulated_variants_use_their_own_compositions() -> None:
    swarm = paper_swarm(10, 0.3, seed=0, rtt=synthetic_rtt()).swarm
    plans = {name: compose(swarm, PAPER_RATE, 0.7, None, name) for name in
             ("proposed", "proposed-spare", "proposed-spare-lb")}
    assert {name: plan.capacity for name, plan in plans.items()} == {
        "proposed": 5, "proposed-spare": 4, "proposed-spare-lb": 3,
    }
    for name, plan in plans.items():
        policy = build_policy(name, swarm, PAPER_RATE, 0.7, seed=0)
        assert policy.name == name and policy.chains == plan.chains
    with pytest.raises(ValueError, match="unknown variant"):
        compose(swarm, PAPER_RATE, 0.7, None, "jffc")
