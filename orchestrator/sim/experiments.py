"""The paper's unit experiments (Sec. 4.1.2, Figs. 3-7) on Sec. 4.1 swarms, with the shipped policies.

Fig. 3  GBP-CR vs random feasible placements: objective c K(c) / lambda of (10), homogeneous and heterogeneous memory.
Fig. 4  job servers needed for rate lambda / rho_bar under GBP-CR's placement: GCA, GBP-CR's own chains, the lower
        bound ceil(lambda / (rho_bar mu_max)) and the optimal integer program over GCA's chains.
Fig. 5  load balancing over fixed GBP-CR + GCA chains: JFFC vs JSQ, JIQ, SED, SA-JSQ, and JFFC vs Theorem 3.7.
Fig. 6  the impact of c: simulated JFFC, the surrogate c K(c) / lambda and the Theorem 3.7 bounds.
Fig. 7  the best c as the arrival rate grows, by simulation and by each tuning rule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from orchestrator.placement import blocks_for_capacity, gbp_cr_plan
from orchestrator.sim.engine import simulate
from orchestrator.sim.methods import build_policy, compose
from orchestrator.sim.overall import cached_rtt
from orchestrator.sim.presets import DEFAULT_RATE_PER_MS, DEFAULT_RHO_BAR, paper_swarm
from orchestrator.sim.runner import map_tasks, seeded_poisson
from orchestrator.swarm_model import Chain, SwarmModel
from orchestrator.tuning import plan_for_capacity, response_bounds_ms, surrogate_objective, tune_capacity

FIG5_POLICIES = ("jffc", "jsq", "jiq", "sed", "sa-jsq")
FIG5_LOADS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class Setting:
    """The swarm family and run length shared by the unit experiments."""

    servers: int = 20
    eta: float = 0.2
    rate_per_ms: float = DEFAULT_RATE_PER_MS
    rho_bar: float = DEFAULT_RHO_BAR
    jobs: int = 2000
    warmup_jobs: int = 200
    rtt_path: str | None = None

    def swarm(self, seed: int) -> SwarmModel:
        return paper_swarm(self.servers, self.eta, seed, cached_rtt(self.rtt_path)).swarm


def random_stacking(swarm: SwarmModel, capacity: int, rate_per_ms: float, rho_bar: float, rng) -> float:
    """Gives c K / lambda (ms) of a random feasible solution of (10): servers stacked into chains in random order."""
    usable = [s for s in swarm.servers if blocks_for_capacity(s, swarm.model, capacity) > 0]
    target, total, chains, covered, time_ms = rate_per_ms / (rho_bar * capacity), 0.0, 0, 0, 0.0
    for index in rng.permutation(len(usable)):
        server = usable[int(index)]
        count = blocks_for_capacity(server, swarm.model, capacity)
        covered += count
        time_ms += server.tau_c_ms + server.tau_p_ms * count
        if covered >= swarm.model.blocks:
            chains, total, covered, time_ms = chains + 1, total + 1.0 / time_ms, 0, 0.0
            if total >= target:
                return capacity * chains / rate_per_ms
    return math.inf


def fig3(setting: Setting, *, seed: int = 0, capacities=(1, 2, 4, 8, 16), samples: int = 500) -> dict:
    """Gives GBP-CR's and random placements' objective per c, for equal memory (40 GB) and the mixed swarm."""
    cases = {}
    base = setting.swarm(seed)
    for case, swarm in (
        ("homogeneous", SwarmModel(base.model, tuple(dataclasses.replace(s, memory_gb=40.0) for s in base.servers))),
        ("heterogeneous", base),
    ):
        rows = []
        for capacity in capacities:
            rng = np.random.default_rng([seed, 44, capacity])
            randoms = np.array([random_stacking(swarm, capacity, setting.rate_per_ms, setting.rho_bar, rng)
                                for _ in range(samples)])
            gbp = surrogate_objective(swarm, capacity, setting.rate_per_ms, setting.rho_bar) / setting.rate_per_ms
            finite = randoms[np.isfinite(randoms)]
            rows.append({
                "c": capacity, "gbp_cr_ms": gbp, "random_ms": finite,
                "random_infeasible": int((~np.isfinite(randoms)).sum()),
                "random_best_ms": float(finite.min()) if finite.size else math.inf,
                "gbp_cr_at_most_best_random": bool(finite.size == 0 or gbp <= finite.min() + 1e-9),
            })
        cases[case] = rows
    return {"figure": 3, "seed": seed, "samples": samples, "cases": cases}


def job_servers_needed(chains: list[tuple[float, int]], need_per_ms: float) -> float:
    """Gives the fewest job servers, fastest first, whose rates sum to `need_per_ms` (inf if all are too few)."""
    used = 0
    for rate, capacity in sorted(chains, key=lambda item: -item[0]):
        if capacity * rate >= need_per_ms - 1e-15:
            return used + math.ceil(need_per_ms / rate - 1e-9)
        used, need_per_ms = used + capacity, need_per_ms - capacity * rate
    return math.inf


def optimal_job_servers(swarm: SwarmModel, placement, chains: tuple[Chain, ...], need_per_ms: float) -> float:
    """Gives min sum c_k over GCA's chains s.t. sum c_k mu_k >= need and every server's slots hold (7), by MILP."""
    servers = sorted({name for chain in chains for name in chain.servers})
    usage = np.zeros((len(servers), len(chains)))
    for k, chain in enumerate(chains):
        for name, count in zip(chain.servers, chain.blocks_per_server, strict=True):
            usage[servers.index(name), k] += count
    slots = np.array([placement.residual_slots(swarm, name) for name in servers], dtype=float)
    rates = np.array([chain.rate_per_ms for chain in chains])
    constraints = [LinearConstraint(usage, -np.inf, slots), LinearConstraint(rates[None, :], need_per_ms, np.inf)]
    result = milp(np.ones(len(chains)), constraints=constraints, integrality=np.ones(len(chains)),
                  bounds=Bounds(0, np.inf))
    return float(round(result.fun)) if result.success else math.inf


def fig4(setting: Setting, *, seed: int = 0, rates_per_s=(0.1, 0.2, 0.3, 0.5, 0.75, 1.0)) -> dict:
    """Gives the job servers needed per arrival rate: GCA, GBP-CR's chains (c each), lower bound, optimal ILP."""
    swarm, rows = setting.swarm(seed), []
    for rate_per_s in rates_per_s:
        rate = rate_per_s / 1000.0
        need = rate / setting.rho_bar
        try:
            plan = tune_capacity(swarm, rate, setting.rho_bar)
        except ValueError:
            rows.append({"rate_per_s": rate_per_s, "feasible": False})
            continue
        disjoint = gbp_cr_plan(swarm, plan.c, rate, setting.rho_bar).chains
        rows.append({
            "rate_per_s": rate_per_s, "feasible": True, "c": plan.c, "chains": len(plan.chains),
            "gca": job_servers_needed([(c.rate_per_ms, c.capacity) for c in plan.chains], need),
            "gbp_cr_disjoint": job_servers_needed([(1.0 / d.service_time_ms, plan.c) for d in disjoint], need),
            "lower_bound": math.ceil(need / max(c.rate_per_ms for c in plan.chains) - 1e-9),
            "optimal_ilp": optimal_job_servers(swarm, plan.placement, plan.chains, need),
        })
    return {"figure": 4, "seed": seed, "rho_bar": setting.rho_bar, "rows": rows}


def _fig5_seed(args: tuple[Setting, int, tuple[str, ...], tuple[float, ...]]) -> list[dict]:
    setting, seed, policies, loads = args
    swarm = setting.swarm(seed)
    plan = compose(swarm, setting.rate_per_ms, setting.rho_bar)
    nu = sum(chain.capacity * chain.rate_per_ms for chain in plan.chains)
    rows = []
    for index, load in enumerate(loads):
        rate = load * nu
        workload = seeded_poisson(rate, setting.jobs, seed * 1000 + index)
        lower, upper = response_bounds_ms(rate, plan.chains)
        row = {"load": load, "rate_per_s": rate * 1000, "lower_ms": lower, "upper_ms": upper, "policies": {}}
        for name in policies:
            policy = build_policy(name, swarm, setting.rate_per_ms, setting.rho_bar, seed)
            result = simulate(policy, workload, swarm, warmup_jobs=setting.warmup_jobs)
            row["policies"][name] = {
                "response_ms": float(result.response_ms.mean()), "service_ms": float(result.service_ms.mean()),
                "waiting_ms": float(result.waiting_ms.mean()),
            }
        rows.append(row)
    return rows


def fig5(setting: Setting, *, seeds: int = 5, loads=FIG5_LOADS, policies=FIG5_POLICIES, workers: int = 1,
         progress: bool = True) -> dict:
    """Gives mean response per load factor rho = lambda / nu over fixed chains: each policy and the bounds."""
    tasks = [(setting, seed, tuple(policies), tuple(loads)) for seed in range(seeds)]
    per_seed = map_tasks(_fig5_seed, tasks, workers=workers, description="fig5", progress=progress)
    rows = []
    for index, load in enumerate(loads):
        mine = [runs[index] for runs in per_seed]
        row = {"load": load, "lower_ms": float(np.mean([r["lower_ms"] for r in mine])),
               "upper_ms": float(np.mean([r["upper_ms"] for r in mine])), "policies": {}}
        for name in policies:
            row["policies"][name] = {
                key: float(np.mean([r["policies"][name][key] for r in mine]))
                for key in ("response_ms", "service_ms", "waiting_ms")
            }
        jffc = row["policies"].get("jffc")
        if jffc:
            row["jffc_service_share"] = jffc["service_ms"] / jffc["response_ms"]
        rows.append(row)
    return {"figure": 5, "seeds": seeds, "rows": rows}


def c_sweep(setting: Setting, swarm: SwarmModel, rate: float, seed: int, capacities) -> list[dict]:
    """Gives, per c, simulated JFFC mean response, the surrogate c K(c) / lambda and the Theorem 3.7 bounds (ms)."""
    rows = []
    workload = seeded_poisson(rate, setting.jobs, seed)
    for capacity in capacities:
        plan = plan_for_capacity(swarm, capacity, rate, setting.rho_bar)
        row = {"c": capacity, "chains": len(plan.chains), "lower_ms": plan.lower_ms, "upper_ms": plan.upper_ms,
               "surrogate_ms": surrogate_objective(swarm, capacity, rate, setting.rho_bar) / rate,
               "simulated_ms": math.inf}
        if plan.chains and plan.stable:
            policy = build_policy("jffc", swarm, rate, setting.rho_bar, seed, capacity=capacity)
            result = simulate(policy, workload, swarm, warmup_jobs=setting.warmup_jobs)
            row["simulated_ms"] = float(result.response_ms.mean())
        rows.append(row)
    return rows


def _fig6_seed(args) -> list[dict]:
    setting, seed, capacities = args
    return c_sweep(setting, setting.swarm(seed), setting.rate_per_ms, seed, capacities)


def _argmin_c(rows: list[dict], key: str) -> int | None:
    finite = [row for row in rows if math.isfinite(row[key])]
    return min(finite, key=lambda row: (row[key], row["c"]))["c"] if finite else None


def fig6(setting: Setting, *, seeds: int = 5, capacities=tuple(range(1, 31)), workers: int = 1,
         progress: bool = True) -> dict:
    """Gives, per c, each curve averaged over seeds (inf where a seed's chains cannot carry the load)."""
    tasks = [(setting, seed, tuple(capacities)) for seed in range(seeds)]
    per_seed = map_tasks(_fig6_seed, tasks, workers=workers, description="fig6", progress=progress)
    rows = []
    for index, capacity in enumerate(capacities):
        mine = [runs[index] for runs in per_seed]
        rows.append({"c": capacity, **{key: float(np.mean([r[key] for r in mine]))
                                       for key in ("simulated_ms", "lower_ms", "upper_ms", "surrogate_ms")}})
    best = {key: _argmin_c(rows, key) for key in ("simulated_ms", "lower_ms", "upper_ms", "surrogate_ms")}
    return {"figure": 6, "seeds": seeds, "rate_per_s": setting.rate_per_ms * 1000, "rows": rows, "best_c": best}


def _fig7_seed(args) -> list[dict]:
    setting, seed, rates_per_s, capacities = args
    swarm, out = setting.swarm(seed), []
    for rate_per_s in rates_per_s:
        rows = c_sweep(setting, swarm, rate_per_s / 1000.0, seed, capacities)
        out.append({key: _argmin_c(rows, key) for key in ("simulated_ms", "lower_ms", "upper_ms", "surrogate_ms")})
    return out


def fig7(setting: Setting, *, seeds: int = 3, rates_per_s=(0.1, 0.2, 0.3, 0.5, 0.75, 1.0),
         capacities=tuple(range(1, 31)), workers: int = 1, progress: bool = True) -> dict:
    """Gives the best c per arrival rate by simulation and by each tuning rule, per seed and averaged."""
    tasks = [(setting, seed, tuple(rates_per_s), tuple(capacities)) for seed in range(seeds)]
    per_seed = map_tasks(_fig7_seed, tasks, workers=workers, description="fig7", progress=progress)
    rows = []
    for index, rate_per_s in enumerate(rates_per_s):
        mine = [runs[index] for runs in per_seed]
        row = {"rate_per_s": rate_per_s}
        for key in ("simulated_ms", "lower_ms", "upper_ms", "surrogate_ms"):
            values = [m[key] for m in mine if m[key] is not None]
            row[key.removesuffix("_ms")] = {"per_seed": [m[key] for m in mine],
                                           "mean": float(np.mean(values)) if values else math.nan}
        rows.append(row)
    return {"figure": 7, "seeds": seeds, "rows": rows}
