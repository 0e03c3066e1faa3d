"""Tuning the required capacity c of GBP-CR: the surrogate (13)-(14) and the paper's bound-based method.

A small c leaves room for more blocks per server (short, fast chains, few cache slots); a large c reserves cache
(more jobs at once, longer chains). The paper's method (Sec. 3.2.3) runs GBP-CR then GCA for every c, skips the c
whose chains cannot carry the load (lambda >= nu), and keeps the c with the smallest Theorem 3.7 lower bound.

The search over c is exact but pruned: any chain's service time is at least L x the smallest amortized per-block
time t~_j(c) of the servers that can host a block, the lower (and upper) bound is at least the fastest chain's
service time, and t~_j(c) only grows with c. So once L min_j t~_j(c) reaches the best bound found, no larger c
can win. Placements that repeat across c are allocated once.

`spare_chains=True` tunes the live-swarm variant: GBP-CR also stacks the servers left over at its stop into spare
chains (see `orchestrator.placement`), GCA allocates over that whole placement, and the objective is evaluated on
it. The pruning floor holds for it too: every chain still runs over servers placed with m_j(c) blocks. With spare
chains, use method "overflow" (ours, not the paper's): the lower bound assumes jobs always sit on the fastest
chains, so it hardly charges the jobs that overflow to slow spare chains and stay there, and it picks a c whose
fast chains are small; the overflow estimate (`analysis.overflow_mean_response`, clamped to the bounds, so the
pruning holds) charges them in full. Over Alg. 1's own placements it chose plans that ran identically to the lower
bound's in all 320 runs of the Fig. 8 grid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrator.allocation import gca, total_rate_per_ms
from orchestrator.analysis import mean_response_bounds, overflow_mean_response, total_rate
from orchestrator.placement import gbp_cr_plan, ranked_servers
from orchestrator.swarm_model import Chain, Placement, SwarmModel, units_that_fit

TuningMethod = Literal["lower_bound", "upper_bound", "surrogate", "overflow"]
TUNING_METHODS: tuple[TuningMethod, ...] = ("lower_bound", "upper_bound", "surrogate", "overflow")


@dataclass(frozen=True)
class TunedPlan:
    """A composed swarm: capacity c, GBP-CR's placement, GCA's chains and JFFC's mean response bounds (ms).

    The bounds are infinite when the chains cannot carry the arrival rate (lambda >= nu). `spare_chains` says
    whether GBP-CR placed the servers left over at its stop as spare chains (not part of the paper's Alg. 1).
    """

    c: int
    placement: Placement
    chains: tuple[Chain, ...]
    lower_ms: float
    upper_ms: float
    spare_chains: bool = False

    @property
    def stable(self) -> bool:
        return math.isfinite(self.lower_ms)

    @property
    def total_rate_per_ms(self) -> float:
        """Gives nu = sum_k c_k mu_k of the chains, in jobs per ms."""
        return total_rate_per_ms(self.chains)


def capacity_limit(swarm: SwarmModel) -> int:
    """Gives c_max = floor((max_j M_j - s_m) / s_c): the most jobs any server could run on one hosted block."""
    model = swarm.model
    largest = max((server.memory_gb for server in swarm.servers), default=0.0)
    return max(0, units_that_fit(largest - model.block_gb, model.cache_gb))


def _check_inputs(swarm: SwarmModel, arrival_rate_per_ms: float, rho_bar: float) -> int:
    if not (arrival_rate_per_ms > 0 and math.isfinite(arrival_rate_per_ms)):
        raise ValueError("the arrival rate must be finite and > 0")
    if not 0 < rho_bar <= 1:
        raise ValueError(f"rho_bar must be in (0, 1], got {rho_bar}")
    limit = capacity_limit(swarm)
    if limit < 1:
        raise ValueError("no server has memory for one block plus one cache slot: there is no capacity to tune")
    return limit


def _stable_inputs(arrival_rate_per_ms: float, chains: Sequence[Chain]) -> tuple[list[float], list[int]] | None:
    """Gives the chains' (rates, capacities) for `analysis`, or None if they cannot carry the load (lambda >= nu).

    nu is `analysis.total_rate`, the very sum `analysis` checks, so a load that passes here never raises there.
    """
    rates = [chain.rate_per_ms for chain in chains]
    capacities = [chain.capacity for chain in chains]
    return (rates, capacities) if arrival_rate_per_ms < total_rate(rates, capacities) else None


def response_bounds_ms(arrival_rate_per_ms: float, chains: Sequence[Chain]) -> tuple[float, float]:
    """Gives Theorem 3.7's (lower, upper) mean response time in ms, or (inf, inf) if the chains are unstable."""
    inputs = _stable_inputs(arrival_rate_per_ms, chains)
    return (math.inf, math.inf) if inputs is None else mean_response_bounds(arrival_rate_per_ms, *inputs)


def overflow_estimate_ms(arrival_rate_per_ms: float, chains: Sequence[Chain]) -> float:
    """Gives the overflow estimate of JFFC's mean response time in ms (see `analysis`), or inf if unstable."""
    inputs = _stable_inputs(arrival_rate_per_ms, chains)
    return math.inf if inputs is None else overflow_mean_response(arrival_rate_per_ms, *inputs)


def plan_for_capacity(
    swarm: SwarmModel, capacity: int, arrival_rate_per_ms: float, rho_bar: float, *, spare_chains: bool = False
) -> TunedPlan:
    """Gives the plan for a fixed c: GBP-CR's placement (with spare chains if asked), GCA's chains, their bounds."""
    _check_inputs(swarm, arrival_rate_per_ms, rho_bar)
    placement = gbp_cr_plan(swarm, capacity, arrival_rate_per_ms, rho_bar, spare_chains=spare_chains).placement
    chains = tuple(gca(swarm, placement))
    lower, upper = response_bounds_ms(arrival_rate_per_ms, chains)
    return TunedPlan(capacity, placement, chains, lower, upper, spare_chains)


def surrogate_chains(swarm: SwarmModel, capacity: int, arrival_rate_per_ms: float, rho_bar: float) -> int | None:
    """Gives K(c) of (13): how many GBP-CR chains reach rate lambda / (rho_bar c), or None if all servers do not."""
    plan = gbp_cr_plan(swarm, capacity, arrival_rate_per_ms, rho_bar)
    return len(plan.chains) if plan.target_met else None


def surrogate_objective(swarm: SwarmModel, capacity: int, arrival_rate_per_ms: float, rho_bar: float) -> float:
    """Gives c K(c), the number of job servers of (14) (divide by lambda for a time); infinite if infeasible."""
    chains = surrogate_chains(swarm, capacity, arrival_rate_per_ms, rho_bar)
    return math.inf if chains is None else float(capacity * chains)


def surrogate_ranking(swarm: SwarmModel, arrival_rate_per_ms: float, rho_bar: float) -> list[int]:
    """Gives the feasible c of 1..c_max by increasing c K(c) of (14) (ties: the smaller c); ValueError if none."""
    limit = _check_inputs(swarm, arrival_rate_per_ms, rho_bar)
    values = {capacity: surrogate_objective(swarm, capacity, arrival_rate_per_ms, rho_bar)
              for capacity in range(1, limit + 1)}
    ranking = sorted((capacity for capacity, value in values.items() if math.isfinite(value)),
                     key=lambda capacity: (values[capacity], capacity))
    if not ranking:
        raise ValueError("no capacity c lets GBP-CR's chains reach lambda / (rho_bar c): too few servers for the load")
    return ranking


def surrogate_capacity(swarm: SwarmModel, arrival_rate_per_ms: float, rho_bar: float) -> int:
    """Gives c* = argmin_c c K(c) of (14) over 1..c_max (ties: the smallest c); ValueError if no c is feasible."""
    return surrogate_ranking(swarm, arrival_rate_per_ms, rho_bar)[0]


def fastest_possible_chain_ms(swarm: SwarmModel, capacity: int) -> float:
    """Gives L x min_j t~_j(c): no chain over a GBP-CR placement for c can be faster (inf if no server fits)."""
    ranked = ranked_servers(swarm, capacity)
    return swarm.model.blocks * ranked[0][0] if ranked else math.inf


def tune_capacity(
    swarm: SwarmModel,
    arrival_rate_per_ms: float,
    rho_bar: float,
    *,
    method: TuningMethod = "lower_bound",
    spare_chains: bool = False,
) -> TunedPlan:
    """Gives the plan whose c minimizes the chosen objective (ties: the smallest c).

    `lower_bound` (the paper's choice) and `upper_bound` minimize Theorem 3.7's bound over GBP-CR + GCA, skipping
    c with lambda >= nu; `overflow` (ours) minimizes the overflow estimate of JFFC's mean response over the same
    plans, which unlike the lower bound charges jobs that overflow to slow chains their full service time (see
    `analysis.overflow_mean_response`); `surrogate` takes the feasible c with the smallest c K(c) (K counts only
    the chains up to Alg. 1's stop) whose plan is stable, as GCA's greedy chains can carry less than the K(c)
    chains of c jobs that (13) counts. With `spare_chains` every candidate placement also holds the spare chains.
    Raises ValueError when no c keeps the swarm stable.
    """
    limit = _check_inputs(swarm, arrival_rate_per_ms, rho_bar)
    if method == "surrogate":
        for capacity in surrogate_ranking(swarm, arrival_rate_per_ms, rho_bar):
            plan = plan_for_capacity(swarm, capacity, arrival_rate_per_ms, rho_bar, spare_chains=spare_chains)
            if plan.stable:
                return plan
        raise ValueError("no capacity c feasible for the surrogate gives GCA chains that carry the arrival rate")
    if method not in TUNING_METHODS:
        raise ValueError(f"unknown tuning method {method!r}; choose one of {', '.join(TUNING_METHODS)}")
    best: TunedPlan | None = None
    best_value = math.inf
    chains_of: dict[tuple[tuple[str, int, int], ...], tuple[Chain, ...]] = {}
    for capacity in range(1, limit + 1):
        greedy = gbp_cr_plan(swarm, capacity, arrival_rate_per_ms, rho_bar, spare_chains=spare_chains)
        if swarm.model.blocks * greedy.fastest_block_ms >= best_value:
            break  # this floor on any chain's time only grows with c: no larger c can beat the best value
        placement = greedy.placement
        key = tuple((name, first, count) for name, (first, count) in placement.blocks.items())
        if key not in chains_of:
            chains_of[key] = tuple(gca(swarm, placement))
        chains = chains_of[key]
        lower, upper = response_bounds_ms(arrival_rate_per_ms, chains)
        if method == "overflow":
            value = overflow_estimate_ms(arrival_rate_per_ms, chains) if math.isfinite(lower) else math.inf
        else:
            value = lower if method == "lower_bound" else upper
        if value < best_value:
            best, best_value = TunedPlan(capacity, placement, chains, lower, upper, spare_chains), value
    if best is None:
        raise ValueError("no capacity c gives chains that carry the arrival rate (lambda >= nu for every c)")
    return best
