"""Fig. 8: the overall comparison, mean response time of every policy over J x eta, averaged over seeds.

Every (J, eta, seed) is one random Sec. 4.1 swarm and one Poisson workload; all policies of that seed see the same
swarm and the same jobs. A policy that cannot serve a swarm at all (e.g. "JFFC only" when no server fits the whole
model) is reported as infeasible there, not averaged in; each run's mean is kept by seed, and paired comparisons
take only the seeds both policies ran. Each variant of the proposed method ("proposed", the paper's Alg. 1, and
"proposed-spare", with spare chains) is compared with every baseline, never with the other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.stats import binomtest

from orchestrator.dispatch_policy import NoFeasiblePlan
from orchestrator.sim.methods import FIG8_POLICIES, PROPOSED, compose
from orchestrator.sim.metrics import summarize
from orchestrator.sim.presets import (
    DEFAULT_RATE_PER_MS,
    DEFAULT_RHO_BAR,
    RttMatrix,
    default_rtt,
    paper_swarm,
)
from orchestrator.sim.report import format_table, seconds
from orchestrator.sim.runner import map_tasks, run_policy, seeded_poisson

FIG8_SERVERS = (10, 20, 30, 40)
FIG8_ETAS = (0.1, 0.2, 0.3, 0.4)
PAPER_REDUCTION = (0.08, 0.83)


@lru_cache(maxsize=4)
def cached_rtt(path: str | None) -> RttMatrix:
    return default_rtt(path)


@dataclass(frozen=True)
class CellRun:
    """One (J, eta, seed) of the grid, with every setting a worker needs."""

    servers: int
    eta: float
    seed: int
    policies: tuple[str, ...]
    jobs: int
    warmup_jobs: int
    rate_per_ms: float
    rho_bar: float
    rtt_path: str | None


def run_cell(task: CellRun) -> dict:
    """Gives each policy's per-job times (or the reason it cannot run) on one swarm and workload."""
    instance = paper_swarm(task.servers, task.eta, task.seed, cached_rtt(task.rtt_path))
    workload = seeded_poisson(task.rate_per_ms, task.jobs, task.seed)
    out: dict = {"rtt_source": instance.rtt_source, "policies": {}}
    for name in task.policies:
        result = run_policy(
            name, instance.swarm, workload, task.rate_per_ms, task.rho_bar, task.seed, warmup_jobs=task.warmup_jobs
        )
        if isinstance(result, NoFeasiblePlan):
            out["policies"][name] = {"infeasible": str(result)}
            continue
        entry = {
            "response_ms": result.response_ms,
            "waiting_ms": result.waiting_ms,
            "service_ms": result.service_ms,
            "chains": len(result.chain_utilization),
        }
        if name in PROPOSED:
            entry["c"] = compose(instance.swarm, task.rate_per_ms, task.rho_bar, None, name).capacity
        out["policies"][name] = entry
    return out


PER_SEED = "mean_response_per_seed_ms"  # {seed: that seed's mean response}: pair policies by seed, never by position


def fig8_cell(servers: int, eta: float, seeded_runs: Sequence[tuple[int, dict]], policies: Sequence[str]) -> dict:
    """Gives one cell of the grid from its (seed, `run_cell` output) pairs: per policy the mean response over the
    seeds it could run, each seed's mean, and per proposed variant the reduction vs PETALS (paired by seed)."""
    cell: dict = {"servers": servers, "eta": eta, "policies": {}}
    for name in policies:
        entries = [(seed, run["policies"][name]) for seed, run in seeded_runs]
        ok = [(seed, e) for seed, e in entries if "infeasible" not in e]
        per_seed = {seed: float(np.mean(e["response_ms"])) for seed, e in ok}
        means = list(per_seed.values())
        stats = {
            "runs": len(ok),
            "infeasible": len(entries) - len(ok),
            "mean_response_ms": float(np.mean(means)) if means else math.nan,
            PER_SEED: per_seed,
            "ci95_ms": 1.96 * float(np.std(means, ddof=1)) / math.sqrt(len(means)) if len(means) > 1 else math.nan,
            "mean_waiting_ms": float(np.mean([np.mean(e["waiting_ms"]) for _, e in ok])) if ok else math.nan,
            "mean_service_ms": float(np.mean([np.mean(e["service_ms"]) for _, e in ok])) if ok else math.nan,
        }
        if name in PROPOSED and ok:
            stats["c"] = [e["c"] for _, e in ok]
        if len(ok) < len(entries):
            stats["reason"] = next(e["infeasible"] for _, e in entries if "infeasible" in e)
        cell["policies"][name] = stats
    variants = [name for name in policies if name in PROPOSED]
    cell["reduction_vs_petals"] = {name: paired_reduction(cell, name, "petals") for name in variants}
    return cell


def paired_means(cell: dict, mine: str, theirs: str) -> tuple[list, list[float], list[float]]:
    """Gives the seeds both policies ran in `cell` (sorted) and each one's mean response on those seeds."""
    own = cell["policies"].get(mine, {}).get(PER_SEED) or {}
    other = cell["policies"].get(theirs, {}).get(PER_SEED) or {}
    seeds = sorted(set(own) & set(other))
    return seeds, [own[seed] for seed in seeds], [other[seed] for seed in seeds]


def paired_reduction(cell: dict, mine: str, baseline: str) -> float:
    """Gives 1 - mean(mine) / mean(baseline) over the seeds both ran in `cell`; NaN if they share none."""
    _, own, other = paired_means(cell, mine, baseline)
    if not own or not np.mean(other):
        return math.nan
    return 1.0 - float(np.mean(own)) / float(np.mean(other))


def fig8(
    *,
    servers: tuple[int, ...] = FIG8_SERVERS,
    etas: tuple[float, ...] = FIG8_ETAS,
    seeds: int = 20,
    first_seed: int = 0,
    policies: tuple[str, ...] = FIG8_POLICIES,
    jobs: int = 1000,
    warmup_jobs: int = 100,
    rate_per_ms: float = DEFAULT_RATE_PER_MS,
    rho_bar: float = DEFAULT_RHO_BAR,
    rtt_path: str | None = None,
    workers: int = 1,
    progress: bool = True,
) -> dict:
    """Gives the Fig. 8 grid: per cell and policy the mean response (mean over seeds of each run's mean)."""
    tasks = [
        CellRun(j, eta, first_seed + s, policies, jobs, warmup_jobs, rate_per_ms, rho_bar, rtt_path)
        for j in servers
        for eta in etas
        for s in range(seeds)
    ]
    runs = map_tasks(run_cell, tasks, workers=workers, description="fig8", progress=progress)
    cells, pooled = [], {name: {"response": [], "waiting": [], "service": []} for name in policies}
    for j in servers:
        for eta in etas:
            mine = [
                (task.seed, run) for task, run in zip(tasks, runs, strict=True) if (task.servers, task.eta) == (j, eta)
            ]
            cells.append(fig8_cell(j, eta, mine, policies))
            for name in policies:
                for _, run in mine:
                    entry = run["policies"][name]
                    if "infeasible" not in entry:
                        pooled[name]["response"].append(entry["response_ms"])
                        pooled[name]["waiting"].append(entry["waiting_ms"])
                        pooled[name]["service"].append(entry["service_ms"])
    overall = {}
    for name, bucket in pooled.items():
        if not bucket["response"]:
            overall[name] = None
            continue
        overall[name] = {
            "runs": len(bucket["response"]),
            "response_ms": summarize(np.concatenate(bucket["response"])),
            "waiting_ms": summarize(np.concatenate(bucket["waiting"])),
            "service_ms": summarize(np.concatenate(bucket["service"])),
        }
    return {
        "figure": 8,
        "settings": {
            "servers": list(servers), "etas": list(etas), "seeds": seeds, "first_seed": first_seed, "jobs": jobs,
            "warmup_jobs": warmup_jobs, "arrival_rate_per_s": rate_per_ms * 1000.0, "rho_bar": rho_bar,
            "policies": list(policies),
        },
        "rtt_source": runs[0]["rtt_source"] if runs else None,
        "cells": cells,
        "overall": overall,
    }


@dataclass(frozen=True)
class PairedComparison:
    """One variant of the proposed method against one baseline over the same seeds (same swarm, same jobs).

    `better`, `worse`, `equal` count seeds where the proposed mean response is lower, higher or identical (equal
    means the two ran the very same chains: a tie, never a win; means within a relative 1e-9 count as identical,
    since the same chain's service time summed in another server order differs in the last bits). `mean_diff_ms` is
    the mean of baseline - proposed.
    """

    verdict: str  # "win", "tie" or "loss"
    better: int
    worse: int
    equal: int
    mean_diff_ms: float


def paired_comparison(mine: list[float], theirs: list[float]) -> PairedComparison:
    """Gives the paired verdict of per-seed means `mine` (proposed) against `theirs` (a baseline).

    The proposed method wins if the 95% interval of the per-seed difference (baseline - proposed) lies above 0, or
    if a two-sided sign test (p < 0.05) says it is better in more seeds than chance: the t interval alone calls a
    20-of-20 win a tie when one seed's baseline blows up. "loss" is the mirror image; anything else is a "tie".
    """
    mine_ms, theirs_ms = np.array(mine), np.array(theirs)
    diff = theirs_ms - mine_ms
    # the same chain summed in another server order differs in the last bits of its service time: that is equal
    diff[np.abs(diff) <= 1e-9 * np.maximum(np.abs(mine_ms), np.abs(theirs_ms))] = 0.0
    half = 1.96 * diff.std(ddof=1) / math.sqrt(diff.size) if diff.size > 1 else 0.0
    low, high = diff.mean() - half, diff.mean() + half
    better, worse = int((diff > 0).sum()), int((diff < 0).sum())
    sign_p = binomtest(better, better + worse).pvalue if better + worse else 1.0
    if low > 0 or (sign_p < 0.05 and better > worse):
        verdict = "win"
    elif high < 0 or (sign_p < 0.05 and worse > better):
        verdict = "loss"
    else:
        verdict = "tie"
    return PairedComparison(verdict, better, worse, int(diff.size) - better - worse, float(diff.mean()))


def paired_between(cell: dict, mine: str, theirs: str) -> PairedComparison | None:
    """Gives how `mine` compares with `theirs` on the seeds of `cell` both ran, or None if they share no seed."""
    seeds, own, other = paired_means(cell, mine, theirs)
    return paired_comparison(own, other) if seeds else None


def paired_comparisons(cell: dict, mine: str = "proposed") -> dict[str, PairedComparison]:
    """Gives, per baseline that ran on some seed `mine` ran too, how proposed variant `mine` compares with it there.

    Seeds where either policy could not run are left out of the pair (a baseline infeasible everywhere, like "JFFC
    only" on most swarms, is not compared at all).
    """
    out = {}
    for name in cell["policies"]:
        if name in PROPOSED:
            continue
        result = paired_between(cell, mine, name)
        if result is not None:
            out[name] = result
    return out


def paired_verdicts(cell: dict, mine: str = "proposed") -> dict[str, str]:
    """Gives, per baseline that shares a seed with `mine`, "win", "tie" or "loss" of proposed variant `mine`."""
    return {name: result.verdict for name, result in paired_comparisons(cell, mine).items()}


def non_wins(cell: dict, mine: str = "proposed") -> list[str]:
    """Gives "tie vs NAME" / "loss vs NAME" for every baseline `mine` does not beat; identical runs are said so."""
    notes = []
    for name, result in sorted(paired_comparisons(cell, mine).items()):
        if result.verdict == "win":
            continue
        seeds = result.better + result.worse + result.equal
        same = f" (identical in {result.equal}/{seeds} seeds)" if result.equal else ""
        notes.append(f"{result.verdict} vs {name}{same}")
    return notes


VARIANT_LABELS = {"proposed": "paper", "proposed-spare": "spare", "proposed-spare-lb": "spare-lb"}


def fig8_table(result: dict) -> str:
    """Gives the grid as a table: mean response (s) per policy per cell; per proposed variant the reduction vs
    PETALS and the baselines it does not beat (paired over seeds)."""
    policies = result["settings"]["policies"]
    variants = [name for name in policies if name in PROPOSED]
    rows = []
    for cell in result["cells"]:
        row: list[object] = [cell["servers"], f"{cell['eta']:.1f}"]
        for name in policies:
            stats = cell["policies"][name]
            row.append(seconds(stats["mean_response_ms"]) if stats["runs"] else "infeasible")
        for name in variants:
            reduction = cell["reduction_vs_petals"][name]
            row.append("-" if not math.isfinite(reduction) else f"{100 * reduction:.1f}%")
            row.append("; ".join(non_wins(cell, name)) or "beats all")
        rows.append(row)
    extra = [f"{label} {VARIANT_LABELS.get(name, name)}" for name in variants for label in ("vs PETALS", "non-wins:")]
    return format_table(["J", "eta", *policies, *extra], rows)
