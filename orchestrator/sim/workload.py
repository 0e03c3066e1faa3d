"""Workloads for the simulator: arrival times and job sizes, from a Poisson process or the Azure LLM trace.

A job of size s on a route with mean service time T takes s * T (the paper's model); sizes have mean 1. Sizes are
exponential (the paper's simulations) or derived from the trace's token counts: a request's size is its per-block
computation time tau_p(l_in, l_out) on the reference GPU over the mean of that time over the replayed requests, so a
long prompt or a long answer makes a proportionally longer job.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np

from orchestrator.sim.presets import HIGH_PERFORMANCE, per_block_time_ms

SIZE_MODELS = ("exponential", "trace")


@dataclass(frozen=True)
class Workload:
    """Arrival times (ms, non-decreasing, first at 0 or later) and job sizes (mean about 1) of one run.

    `cache_units`, if given, is the KV each job holds per block as a share of the model's s_c (a job of half the
    planned tokens: 0.5); by default every job holds s_c, the paper's static reservation. Servers admit by it where
    policies route per request (PETALS, BPRR, Helix-style), as paged servers admit a session by its own length.
    `prompts`, if given, is each job's prompt relative to the mean job's, which sets its prefill phase where servers
    have a prefill share (`ServerSpec.tau_p_prefill_ms`); by default a job's prompt is in proportion to its size.
    """

    arrivals_ms: np.ndarray
    sizes: np.ndarray
    description: str
    cache_units: np.ndarray | None = None
    prompts: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.arrivals_ms.shape != self.sizes.shape or self.arrivals_ms.ndim != 1:
            raise ValueError("arrivals and sizes must be 1-D arrays of the same length")
        if self.arrivals_ms.size and np.any(np.diff(self.arrivals_ms) < 0):
            raise ValueError("arrival times must be non-decreasing")
        if self.cache_units is not None and (self.cache_units.shape != self.sizes.shape
                                             or np.any(self.cache_units <= 0) or np.any(self.cache_units > 1)):
            raise ValueError("cache_units must give every job a share in (0, 1] of s_c")
        if self.prompts is not None and (self.prompts.shape != self.sizes.shape or np.any(self.prompts < 0)):
            raise ValueError("prompts must give every job a prompt size >= 0")

    def units(self, job: int) -> float:
        """Gives the share of s_c that `job` holds per block."""
        return 1.0 if self.cache_units is None else float(self.cache_units[job])

    def prompt(self, job: int) -> float | None:
        """Gives `job`'s prompt relative to the mean job's (None: in proportion to its size)."""
        return None if self.prompts is None else float(self.prompts[job])

    @property
    def jobs(self) -> int:
        return int(self.arrivals_ms.size)

    @property
    def rate_per_ms(self) -> float:
        """Gives the mean arrival rate over the workload's span."""
        span = float(self.arrivals_ms[-1] - self.arrivals_ms[0]) if self.jobs > 1 else 0.0
        return (self.jobs - 1) / span if span > 0 else 0.0


def poisson_workload(rate_per_ms: float, jobs: int, rng: np.random.Generator) -> Workload:
    """Gives `jobs` Poisson arrivals at `rate_per_ms` with Exp(1) sizes (Sec. 4.1)."""
    if rate_per_ms <= 0 or jobs < 1:
        raise ValueError("a Poisson workload needs a positive rate and at least one job")
    gaps = rng.exponential(1.0 / rate_per_ms, size=jobs)
    gaps[0] = 0.0
    sizes = rng.exponential(1.0, size=jobs)
    return Workload(np.cumsum(gaps), sizes, f"Poisson {rate_per_ms * 1000:g}/s, Exp(1) sizes")


@dataclass(frozen=True)
class Trace:
    """An LLM request trace: arrival seconds from its first request, prompt and output tokens."""

    seconds: np.ndarray
    context_tokens: np.ndarray
    generated_tokens: np.ndarray
    name: str

    def __len__(self) -> int:
        return int(self.seconds.size)


def _seconds_of_day(stamp: str) -> tuple[date, float]:
    day, clock = stamp.strip().split(" ")
    hours, minutes, seconds = clock.split(":")
    return date.fromisoformat(day), int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def load_azure_trace(path: str | Path) -> Trace:
    """Gives the Azure LLM inference trace (2023) in `path`: TIMESTAMP, ContextTokens, GeneratedTokens columns."""
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    first_day: date | None = None
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not an Azure LLM trace (missing columns {', '.join(sorted(missing))})")
        for row in reader:
            day, seconds = _seconds_of_day(row["TIMESTAMP"])
            first_day = first_day or day
            seconds += (day - first_day).days * 86400
            rows.append((seconds, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    if not rows:
        raise ValueError(f"{path}: the trace has no requests")
    rows.sort(key=lambda row: row[0])  # stable: equal timestamps keep file order
    table = np.array(rows, dtype=float)
    return Trace(table[:, 0] - table[0, 0], table[:, 1].astype(np.int64), table[:, 2].astype(np.int64), path.name)


def with_mean_lengths(trace: Trace, prompt_mean: float, output_mean: float) -> Trace:
    """Gives `trace` with every prompt and output scaled so that their means are those given (each at least 1 token).

    Stands in for a dataset that is not in `data/` but whose mean lengths are known, keeping the trace's spread.
    """
    if prompt_mean <= 0 or output_mean <= 0:
        raise ValueError("mean lengths must be > 0")
    prompts = np.maximum(1, np.round(trace.context_tokens * (prompt_mean / float(np.mean(trace.context_tokens)))))
    outputs = np.maximum(1, np.round(trace.generated_tokens * (output_mean / float(np.mean(trace.generated_tokens)))))
    name = f"{trace.name} scaled to means of {prompt_mean:g} and {output_mean:g} tokens"
    return Trace(trace.seconds, prompts.astype(np.int64), outputs.astype(np.int64), name)


def trace_sizes(trace: Trace, count: int | None = None) -> np.ndarray:
    """Gives the sizes of the first `count` requests (all if None): per-block time on the reference GPU, mean 1.

    The mean is taken over those requests, not the whole trace: a prefix normalized by the whole trace's mean would
    load the swarm more (or less) than the rate its c was tuned for.
    """
    end = len(trace) if count is None else count
    work = per_block_time_ms(HIGH_PERFORMANCE, trace.context_tokens[:end], np.maximum(trace.generated_tokens[:end], 1))
    return work / work.mean()


def trace_workload(
    trace: Trace,
    *,
    jobs: int | None,
    rate_per_ms: float | None,
    sizes: str,
    rng: np.random.Generator,
) -> Workload:
    """Gives the first `jobs` requests of `trace` (all if None), time-scaled to `rate_per_ms` unless it is None.

    Scaling keeps the trace's burstiness and only changes its mean rate, so a small swarm can replay a trace
    recorded on a large service. `sizes` is "trace" (from token counts) or "exponential" (Exp(1)).
    """
    if sizes not in SIZE_MODELS:
        raise ValueError(f"unknown size model {sizes!r}; choose from {', '.join(SIZE_MODELS)}")
    count = len(trace) if jobs is None else min(jobs, len(trace))
    if count < 2:
        raise ValueError("a trace workload needs at least two requests")
    arrivals = trace.seconds[:count] * 1000.0
    native = (count - 1) / float(arrivals[-1] - arrivals[0])
    if rate_per_ms is not None:
        arrivals = (arrivals - arrivals[0]) * (native / rate_per_ms)
    job_sizes = trace_sizes(trace, count) if sizes == "trace" else rng.exponential(1.0, size=count)
    rate = rate_per_ms if rate_per_ms is not None else native
    scale = "native rate" if rate_per_ms is None else f"time-scaled from {native * 1000:.3g}/s"
    return Workload(
        np.asarray(arrivals, dtype=float),
        np.asarray(job_sizes, dtype=float),
        f"trace {trace.name}: {count} requests at {rate * 1000:.3g}/s ({scale}), {sizes} sizes",
    )
