"""GCA (Alg. 2) under any placement: the worked example, validity, no over-allocation, and each chain is a
shortest path of what is left (checked against exhaustive path enumeration)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.allocation import chain_blocks, gca, make_chain, slot_use, total_rate_per_ms
from orchestrator.placement import gbp_cr, gbp_cr_plan
from orchestrator.swarm_model import Chain, ModelSpec, Placement, ServerSpec, SwarmModel
from tests.test_placement import fig2_swarm


def test_worked_example_finds_three_chains_of_capacity_five() -> None:
    """In the spirit of the paper's Fig. 2 (its numbers were lost), computed by hand.

    GBP-CR at c = 5 stacks (A, B) and (C, D, E). Residual slots: A 10, B 15, C = D = E 10. Costs: A after the
    start 30, B after A 20 (1 block), B after C 30 (2 blocks), C 30, D 30, E 30. Shortest paths in turn:
    A-B (50 ms, min(10/2, 15/1) = 5 jobs), then C-B (60 ms, min(10/1, 10/2) = 5), then C-D-E (90 ms, 5).
    """
    swarm = fig2_swarm()
    placement = gbp_cr(swarm, 5, arrival_rate_per_ms=1.0, rho_bar=1.0)
    chains = gca(swarm, placement)
    assert chains == [
        Chain(("A", "B"), (2, 1), 5, 50.0),
        Chain(("C", "B"), (1, 2), 5, 60.0),
        Chain(("C", "D", "E"), (1, 1, 1), 5, 90.0),
    ]
    use = slot_use(swarm, placement, chains)
    assert {name: (u.total, u.used, u.free) for name, u in use.items()} == {
        "A": (10, 10, 0), "B": (15, 15, 0), "C": (10, 10, 0), "D": (10, 5, 5), "E": (10, 5, 5),
    }
    # GBP-CR's own disjoint chains with c = 5 each give 5/60 + 5/90; GCA adds a third chain on the same placement
    assert total_rate_per_ms(chains) == pytest.approx(5 / 50 + 5 / 60 + 5 / 90)


def test_chain_blocks_checks_that_a_chain_covers_every_block_in_order() -> None:
    placement = Placement({"A": (1, 2), "B": (2, 2), "C": (1, 1), "D": (2, 1), "E": (3, 1)})
    assert chain_blocks(placement, 3, ["A", "B"]) == (2, 1)
    assert chain_blocks(placement, 3, ["C", "B"]) == (1, 2)
    with pytest.raises(ValueError, match="stops after block 2"):
        chain_blocks(placement, 3, ["C", "D"])
    with pytest.raises(ValueError, match="cannot continue"):
        chain_blocks(placement, 3, ["A", "D", "E"])  # D hosts block 2 only, A already ran it
    with pytest.raises(ValueError, match="cannot continue"):
        chain_blocks(placement, 3, ["B"])  # B does not host block 1


def test_no_chain_when_the_placement_misses_a_block() -> None:
    swarm = fig2_swarm()
    assert gca(swarm, Placement({"A": (1, 2), "C": (1, 1)})) == []
    assert gca(swarm, Placement({})) == []


def test_placement_outside_the_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="outside"):
        gca(fig2_swarm(), Placement({"A": (3, 2)}))
    with pytest.raises(ValueError, match="does not have: Z"):
        gca(fig2_swarm(), Placement({"A": (1, 2), "Z": (1, 3)}))


@st.composite
def placed_swarms(draw: st.DrawFn) -> tuple[SwarmModel, Placement]:
    """Any placement (not only GBP-CR's): random contiguous ranges, memory for them plus a few cache slots."""
    blocks = draw(st.integers(1, 4))
    model = ModelSpec(blocks, 1.0, 1.0)
    servers, ranges = [], {}
    for index in range(draw(st.integers(1, 7))):
        first = draw(st.integers(1, blocks))
        count = draw(st.integers(0, blocks - first + 1))
        slots = draw(st.integers(0, 9))
        name = f"s{index}"
        servers.append(ServerSpec(name, float(count + slots), float(draw(st.integers(0, 9))),
                                  float(draw(st.integers(1, 9)))))
        ranges[name] = (first if count else 0, count)
    return SwarmModel(model, tuple(servers)), Placement(ranges)


def all_chains(swarm: SwarmModel, placement: Placement) -> list[tuple[str, ...]]:
    """Gives every server sequence that covers blocks 1..L in order (exhaustive depth-first search)."""
    found: list[tuple[str, ...]] = []

    def extend(prefix: tuple[str, ...], boundary: int) -> None:
        if boundary == swarm.model.blocks + 1:
            found.append(prefix)
            return
        for server in swarm.servers:
            first, count = placement.first_block(server.name), placement.num_blocks(server.name)
            if count and first <= boundary <= first + count - 1:
                extend((*prefix, server.name), first + count)

    extend((), 1)
    return found


def check_gca_result(swarm: SwarmModel, placement: Placement, chains: list[Chain]) -> None:
    """Replays Alg. 2 exhaustively: every chain is valid and is a cheapest one with room when GCA took it, gets
    the largest capacity that fits, slots are never over-committed, and nothing is left when GCA stops."""
    residual = {server.name: placement.residual_slots(swarm, server.name) for server in swarm.servers}
    candidates = [(servers, chain_blocks(placement, swarm.model.blocks, servers))
                  for servers in all_chains(swarm, placement)]

    def fits(blocks_of: tuple[tuple[str, ...], tuple[int, ...]]) -> bool:
        servers, blocks = blocks_of
        return all(residual[name] >= count for name, count in zip(servers, blocks, strict=True))

    for chain in chains:
        assert chain == make_chain(swarm, placement, chain.servers, chain.capacity)  # valid, times consistent
        assert chain.capacity >= 1
        cheapest = min(make_chain(swarm, placement, servers, 1).service_time_ms
                       for servers, blocks in candidates if fits((servers, blocks)))
        assert chain.service_time_ms == pytest.approx(cheapest)
        assert chain.capacity == min(residual[name] // count
                                     for name, count in zip(chain.servers, chain.blocks_per_server, strict=True))
        for name, count in zip(chain.servers, chain.blocks_per_server, strict=True):
            residual[name] -= count * chain.capacity
            assert residual[name] >= 0
    assert not any(fits(candidate) for candidate in candidates)
    times = [chain.service_time_ms for chain in chains]
    assert times == sorted(times)
    for use in slot_use(swarm, placement, chains).values():
        assert 0 <= use.used <= use.total


@settings(max_examples=150, deadline=None)
@given(placed_swarms())
def test_gca_under_any_placement_is_alg2_and_never_over_allocates(case: tuple[SwarmModel, Placement]) -> None:
    swarm, placement = case
    check_gca_result(swarm, placement, gca(swarm, placement))


def paper_like_swarm(count: int, seed: int) -> SwarmModel:
    """BLOOM-176B with 20% fast (40 GB, 109 ms/block) and 80% slow (20 GB, 175 ms/block) servers."""
    rng = random.Random(seed)
    fast = set(rng.sample(range(count), max(1, count // 5)))
    servers = tuple(
        ServerSpec(f"s{index:02d}", 40.0 if index in fast else 20.0, 18.0 + rng.uniform(5, 60),
                   109.0 if index in fast else 175.0)
        for index in range(count)
    )
    return SwarmModel(ModelSpec(70, 1.32, 0.11), servers)


@pytest.mark.parametrize("capacity", [1, 4, 12])
def test_gca_over_gbp_cr_keeps_the_reserved_capacity(capacity: int) -> None:
    swarm = paper_like_swarm(30, seed=3)
    plan = gbp_cr_plan(swarm, capacity, arrival_rate_per_ms=1.0, rho_bar=1.0)  # every server used
    chains = gca(swarm, plan.placement)
    assert chains == gca(swarm, plan.placement)  # deterministic
    for use in slot_use(swarm, plan.placement, chains).values():
        assert 0 <= use.used <= use.total
    for chain in chains:
        assert chain == make_chain(swarm, plan.placement, chain.servers, chain.capacity)
    assert len(plan.chains) >= 1 and len(chains) >= 1  # a GBP-CR chain has room for c jobs, so GCA finds one
