"""Running many seeded simulations: one run of a policy, a progress bar, and optional worker processes.

Each task carries everything it needs (instance parameters and seed), so results do not depend on which worker ran
it or in which order tasks finished: the map keeps the task order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

import numpy as np
from tqdm import tqdm

from orchestrator.dispatch_policy import NoFeasiblePlan
from orchestrator.sim.engine import simulate
from orchestrator.sim.methods import build_policy
from orchestrator.sim.metrics import RunResult
from orchestrator.sim.workload import Workload, poisson_workload
from orchestrator.swarm_model import SwarmModel

WORKLOAD_STREAM = 22  # the seed stream of arrivals and sizes: every policy of a seed sees the same jobs

T = TypeVar("T")
R = TypeVar("R")


def seeded_poisson(rate_per_ms: float, jobs: int, seed: int) -> Workload:
    """Gives the Poisson workload of `seed` (the same for every policy: common random numbers)."""
    return poisson_workload(rate_per_ms, jobs, np.random.default_rng([seed, WORKLOAD_STREAM]))


def run_policy(
    name: str,
    swarm: SwarmModel,
    workload: Workload,
    arrival_rate_per_ms: float,
    rho_bar: float,
    seed: int,
    *,
    warmup_jobs: int,
    capacity: int | None = None,
    ranking: SwarmModel | None = None,
) -> RunResult | NoFeasiblePlan:
    """Gives one run of policy `name` on `swarm`, or the NoFeasiblePlan it raised (a result too: the policy cannot
    serve); `ranking`: the swarm as the policy sees it, when it differs (see `build_policy`)."""
    try:
        policy = build_policy(name, swarm, arrival_rate_per_ms, rho_bar, seed, capacity=capacity, ranking=ranking,
                              job_units=workload.units if workload.cache_units is not None else None)
    except NoFeasiblePlan as error:
        return error
    return simulate(policy, workload, swarm, warmup_jobs=warmup_jobs)


def map_tasks(
    function: Callable[[T], R], tasks: Sequence[T], *, workers: int = 1, description: str = "", progress: bool = True
) -> list[R]:
    """Gives [function(task) for task in tasks], in task order, on `workers` processes, with a progress bar."""
    workers = max(1, min(workers, os.cpu_count() or 1, len(tasks) or 1))
    bar = tqdm(total=len(tasks), desc=description, unit="run", disable=not progress, leave=False)
    try:
        if workers == 1:
            results = []
            for task in tasks:
                results.append(function(task))
                bar.update(1)
            return results
        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = []
            for result in pool.map(function, tasks, chunksize=1):
                results.append(result)
                bar.update(1)
            return results
    finally:
        bar.close()


def finite_mean(values: Iterable[float]) -> float:
    """Gives the mean of the finite values, NaN if there are none."""
    kept = [v for v in values if np.isfinite(v)]
    return float(np.mean(kept)) if kept else float("nan")
