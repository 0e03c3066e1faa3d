"""Sessions for the KV-packing simulator: Poisson arrivals or the Azure trace's, lengths from the trace, scaled.

Lengths are (prompt, output) token pairs of the Azure LLM inference trace; Poisson runs draw pairs from it at random
(the paper's LMSYS-Chat-1M and WildChat are not in `data/`). A length scale multiplies both, as the paper scales its
conversations x10. A session must fit one bin (MELL assumes it): one longer than `max_tokens` keeps its output (at
most max_tokens - 1) and loses the start of its prompt, as a chat front end truncates history [chosen]; the count of
such clipped sessions is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orchestrator.packing import SizeClass, size_class
from orchestrator.sim.packing_sim_records import SessionSpec
from orchestrator.sim.workload import Trace


@dataclass(frozen=True)
class SessionWorkload:
    """The sessions of one run and how they were made."""

    sessions: list[SessionSpec]
    clipped: int
    description: str


def scaled_lengths(prompt: int, output: int, scale: float, max_tokens: int) -> tuple[int, int, bool]:
    """Gives (prompt, output, clipped): both x `scale` (output at least 1), cut to fit `max_tokens` in all."""
    if max_tokens < 2:
        raise ValueError("a bin must hold at least two tokens")
    prompt_tokens = max(0, round(prompt * scale))
    output_tokens = max(1, round(output * scale))
    if prompt_tokens + output_tokens <= max_tokens:
        return prompt_tokens, output_tokens, False
    output_tokens = min(output_tokens, max_tokens - 1)
    return max_tokens - output_tokens, output_tokens, True


def _sessions(
    arrivals_s: np.ndarray, prompts: np.ndarray, outputs: np.ndarray, scale: float, max_tokens: int, prefix: str
) -> tuple[list[SessionSpec], int]:
    sessions, clipped = [], 0
    for index, (arrival, prompt, output) in enumerate(zip(arrivals_s, prompts, outputs, strict=True)):
        prompt_tokens, output_tokens, cut = scaled_lengths(int(prompt), int(output), scale, max_tokens)
        clipped += cut
        sessions.append(SessionSpec(f"{prefix}{index:06d}", float(arrival), prompt_tokens, output_tokens))
    return sessions, clipped


def poisson_sessions(
    trace: Trace, rate_per_s: float, count: int, scale: float, max_tokens: int, seed: int
) -> SessionWorkload:
    """Gives `count` Poisson arrivals at `rate_per_s` (first at 0) with (prompt, output) pairs drawn from `trace`."""
    if rate_per_s <= 0 or count < 1:
        raise ValueError("a Poisson workload needs a positive rate and at least one session")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate_per_s, size=count)
    gaps[0] = 0.0
    rows = rng.integers(0, len(trace), size=count)
    sessions, clipped = _sessions(
        np.cumsum(gaps), trace.context_tokens[rows], trace.generated_tokens[rows], scale, max_tokens, "p"
    )
    return SessionWorkload(sessions, clipped, f"Poisson {rate_per_s:g}/s, {count} sessions, lengths x{scale:g}")


def trace_sessions(trace: Trace, count: int, scale: float, max_tokens: int, start: int = 0) -> SessionWorkload:
    """Gives requests start .. start+count of `trace` at their own times (from 0), lengths x `scale`."""
    end = min(len(trace), start + count)
    if end <= start:
        raise ValueError("the trace window is empty")
    arrivals = trace.seconds[start:end] - trace.seconds[start]
    sessions, clipped = _sessions(
        arrivals, trace.context_tokens[start:end], trace.generated_tokens[start:end], scale, max_tokens, "a"
    )
    rate = (end - start - 1) / float(arrivals[-1]) if arrivals[-1] > 0 else 0.0
    return SessionWorkload(
        sessions, clipped, f"{trace.name} requests {start}-{end - 1} ({rate:.2f}/s), lengths x{scale:g}"
    )


def class_histogram(sessions: Sequence[SessionSpec], tokens_per_page: int, capacity_pages: int) -> dict[SizeClass, int]:
    """Gives how many sessions end (prompt + output) in each size class on bins of `capacity_pages` pages."""
    counts = dict.fromkeys((SizeClass.L, SizeClass.M, SizeClass.S, SizeClass.T, SizeClass.TINY), 0)
    for session in sessions:
        pages = -(-session.final_tokens // tokens_per_page)
        counts[size_class(pages, capacity_pages)] += 1
    return counts
