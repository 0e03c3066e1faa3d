"""Every policy `swarm-sim` can run, by name, built for one swarm, arrival rate, rho_bar and seed.

"proposed" is the paper's method with the shipped code: c tuned by the Theorem 3.7 lower bound, GBP-CR, GCA, JFFC.
"proposed-spare" adds GBP-CR's spare chains (the servers left over at Alg. 1's stop are stacked into further chains)
and tunes c on that placement by the overflow estimate of JFFC's response (`tuning`, method "overflow"): what a live
swarm would run, since it leaves no GPU idle. "proposed-spare-lb" tunes the same placements by the lower bound; it
is kept for comparison: the bound ignores that jobs overflowing to slow spare chains stay on them, so it picks
small c whose one fast chain is soon full (see benchmarks/RESULTS.md).
"jffc", "jsq", "jiq", "sed", "sa-jsq" dispatch over the same GBP-CR + GCA chains (Fig. 5a); the others are the
baselines of `orchestrator.baselines`, each with its own placement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from orchestrator.baselines.bprr import bprr
from orchestrator.baselines.helix import helix
from orchestrator.baselines.jffc import jffc_only
from orchestrator.baselines.load_balancing import RULES, DedicatedQueues
from orchestrator.baselines.parallax import parallax
from orchestrator.baselines.petals import petals, petals_retry
from orchestrator.dispatch import JFFCPolicy
from orchestrator.dispatch_policy import DispatchPolicy, NoFeasiblePlan
from orchestrator.swarm_model import Chain, Placement, SwarmModel
from orchestrator.tuning import TuningMethod, plan_for_capacity, tune_capacity

BASELINES = ("petals", "bprr", "parallax", "helix", "jffc-only")
CLIENT_MODELS = ("petals-retry",)  # a baseline as the live clients run it (not in the paper's figures)
PROPOSED = ("proposed", "proposed-spare", "proposed-spare-lb")  # paper-exact Alg. 1; spare chains (two tunings)
SPARE_TUNING: dict[str, TuningMethod] = {"proposed-spare": "overflow", "proposed-spare-lb": "lower_bound"}
LOAD_BALANCERS = ("jffc", *RULES)
POLICIES = (*PROPOSED, *BASELINES, *CLIENT_MODELS, *LOAD_BALANCERS)
FIG8_POLICIES = (*BASELINES, "proposed", "proposed-spare")
POLICY_STREAM = 33  # the seed stream of a policy's own randomness (PETALS' join order, JSQ ties, ...)


@dataclass(frozen=True)
class Composition:
    """GBP-CR + GCA for one c: the placement, the chains and the c used (tuned or given)."""

    capacity: int
    placement: Placement
    chains: tuple[Chain, ...]


@lru_cache(maxsize=256)
def compose(
    swarm: SwarmModel,
    arrival_rate_per_ms: float,
    rho_bar: float,
    capacity: int | None = None,
    variant: str = "proposed",
) -> Composition:
    """Gives the composition of a proposed variant: c tuned unless `capacity` is given, GBP-CR, then GCA."""
    if variant not in PROPOSED:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(PROPOSED)}")
    name, spare_chains = variant, variant != "proposed"
    if capacity is None:
        method = SPARE_TUNING.get(variant, "lower_bound")
        try:
            plan = tune_capacity(swarm, arrival_rate_per_ms, rho_bar, method=method, spare_chains=spare_chains)
        except ValueError as error:
            raise NoFeasiblePlan(f"{name}: {error}") from None
        return Composition(plan.c, plan.placement, tuple(plan.chains))
    plan = plan_for_capacity(swarm, capacity, arrival_rate_per_ms, rho_bar, spare_chains=spare_chains)
    if not plan.chains:
        raise NoFeasiblePlan(f"{name}: GBP-CR with c = {capacity} leaves no chain through every block")
    return Composition(capacity, plan.placement, plan.chains)


def build_policy(
    name: str,
    swarm: SwarmModel,
    arrival_rate_per_ms: float,
    rho_bar: float,
    seed: int,
    *,
    capacity: int | None = None,
    ranking: SwarmModel | None = None,
    job_units: Callable[[int], float] | None = None,
) -> DispatchPolicy:
    """Gives a fresh policy `name` for one run; raises NoFeasiblePlan when it cannot serve this swarm. JFFC ranks
    chains by their loaded service time with the batch slopes of `ranking` (the swarm as the live orchestrator sees
    it; default `swarm`; one without slopes gives the paper's ranking), while the simulator slows jobs down by
    `swarm`'s. PETALS' servers admit each job by its `job_units` of KV (`Workload.units`), when given."""
    rng = np.random.default_rng([seed, POLICY_STREAM])
    ranking = ranking or swarm
    if name in PROPOSED or name in LOAD_BALANCERS:
        plan = compose(swarm, arrival_rate_per_ms, rho_bar, capacity, name if name in PROPOSED else "proposed")
        if name in (*PROPOSED, "jffc"):
            return JFFCPolicy(plan.chains, plan.placement, name=name, swarm=ranking)
        return DedicatedQueues(plan.chains, plan.placement, name, rng)
    if name == "petals":
        return petals(swarm, rng, job_units)
    if name == "petals-retry":
        return petals_retry(swarm, rng, job_units=job_units)
    if name == "bprr":
        return bprr(swarm, arrival_rate_per_ms)
    if name == "parallax":
        return parallax(swarm)
    if name == "helix":
        return helix(swarm)
    if name == "jffc-only":
        return jffc_only(swarm, ranking=ranking)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
