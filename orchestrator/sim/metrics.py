"""Per-job times and per-chain/per-server utilization of a run, their summaries, and aggregates over seeds.

Waiting = start - arrival, service = end - start, response = end - arrival (ms). Summaries skip the first
`warmup_jobs` arrivals (the system starts empty). Utilization is time-averaged over the whole run: for a chain,
the mean of (jobs running) / capacity; for a server, the mean share of its cache slots in use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from orchestrator.sim.workload import Workload

PERCENTILES = {"median": 50.0, "p95": 95.0, "p99": 99.0}


def summarize(values_ms: np.ndarray) -> dict[str, float]:
    """Gives mean, median, P95, P99 and max of `values_ms` (NaN for an empty array)."""
    if values_ms.size == 0:
        return {key: math.nan for key in ("mean", *PERCENTILES, "max")}
    stats = {"mean": float(values_ms.mean())}
    for key, q in PERCENTILES.items():
        stats[key] = float(np.percentile(values_ms, q))
    stats["max"] = float(values_ms.max())
    return stats


@dataclass(frozen=True)
class RunResult:
    """One run: per-job arrays and the summaries that tables and JSON show."""

    policy: str
    workload: str
    arrivals_ms: np.ndarray
    start_ms: np.ndarray
    end_ms: np.ndarray
    chain_of: np.ndarray
    warmup_jobs: int
    chain_utilization: list[dict] = field(default_factory=list)
    server_utilization: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_run(
        cls,
        policy,
        workload: Workload,
        start: np.ndarray,
        end: np.ndarray,
        chain_of: np.ndarray,
        slot_ms: Mapping[str, float],
        slots: Mapping[str, int],
        warmup_jobs: int,
    ) -> RunResult:
        horizon = float(end.max() - workload.arrivals_ms[0]) if start.size else 0.0
        service = end - start
        chains = []
        for index, chain in enumerate(policy.chains):
            busy = float(service[chain_of == index].sum())
            chains.append(
                {
                    "chain": index,
                    "servers": list(chain.servers),
                    "capacity": chain.capacity,
                    "service_time_ms": chain.service_time_ms,
                    "jobs": int((chain_of == index).sum()),
                    "utilization": busy / (chain.capacity * horizon) if horizon > 0 else 0.0,
                }
            )
        servers = {
            name: (slot_ms[name] / (slots[name] * horizon) if slots[name] and horizon > 0 else 0.0)
            for name in sorted(slots)
        }
        warmup = min(max(warmup_jobs, 0), max(start.size - 1, 0))
        arrivals = workload.arrivals_ms
        return cls(policy.name, workload.description, arrivals, start, end, chain_of, warmup, chains, servers)

    @property
    def measured(self) -> slice:
        return slice(self.warmup_jobs, None)

    @property
    def response_ms(self) -> np.ndarray:
        return (self.end_ms - self.arrivals_ms)[self.measured]

    @property
    def waiting_ms(self) -> np.ndarray:
        return (self.start_ms - self.arrivals_ms)[self.measured]

    @property
    def service_ms(self) -> np.ndarray:
        return (self.end_ms - self.start_ms)[self.measured]

    def summary(self) -> dict:
        """Gives the JSON-ready summary: job counts, response/waiting/service stats, utilizations."""
        return {
            "policy": self.policy,
            "workload": self.workload,
            "jobs": int(self.arrivals_ms.size),
            "measured_jobs": int(self.response_ms.size),
            "response_ms": summarize(self.response_ms),
            "waiting_ms": summarize(self.waiting_ms),
            "service_ms": summarize(self.service_ms),
            "waited_share": float((self.waiting_ms > 0).mean()) if self.waiting_ms.size else math.nan,
            "chains": self.chain_utilization,
            "server_utilization": self.server_utilization,
        }


def pooled_summary(runs: Sequence[RunResult]) -> dict:
    """Gives stats over the measured jobs of several runs pooled, plus the spread of the per-run means."""
    response = np.concatenate([run.response_ms for run in runs])
    waiting = np.concatenate([run.waiting_ms for run in runs])
    service = np.concatenate([run.service_ms for run in runs])
    means = np.array([run.response_ms.mean() for run in runs])
    half_width = 1.96 * means.std(ddof=1) / math.sqrt(means.size) if means.size > 1 else math.nan
    return {
        "runs": len(runs),
        "measured_jobs": int(response.size),
        "response_ms": summarize(response),
        "waiting_ms": summarize(waiting),
        "service_ms": summarize(service),
        "mean_response_per_run_ms": [float(m) for m in means],
        "mean_response_ci95_ms": float(half_width),
    }
