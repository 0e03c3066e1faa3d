"""MELL's GPU priorities (Sec. VI-C); the paper leaves their weights to the provider, chainswarm sets them (spec 5.4).

    prio(j)       = free(j) / C - 0.5 * sessions(j) / max_sessions
    prio(j -> j') = prio(j') - rtt_ms(j, j') / 100          (the RTT term is 0 when no RTTs are given)

A bin with more free pages and fewer sessions, close to j, ranks higher; ties go to the smallest bin id.
`max_sessions` defaults to the most sessions any active bin holds at that moment (at least 1) [chosen: the spec names
the term but no value]. An RTT is looked up as (j, j') and then (j', j); a pair missing from the table counts 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class PriorityWeights:
    """The weights of prio(j) and prio(j -> j')."""

    free_weight: float = 1.0
    session_weight: float = 0.5
    rtt_weight_per_ms: float = 0.01
    max_sessions: int | None = None  # None: the most sessions any active bin holds now


def bin_priority(
    free_pages: int, capacity_pages: int, sessions: int, max_sessions: int, weights: PriorityWeights
) -> float:
    """Gives prio(j) of a bin with `free_pages` free pages and `sessions` sessions."""
    return weights.free_weight * free_pages / capacity_pages - weights.session_weight * sessions / max(max_sessions, 1)


def rtt_between(rtt_ms: Mapping[tuple[str, str], float] | None, src: str, dst: str) -> float:
    """Gives the RTT between two bins in ms, 0 when unknown."""
    if rtt_ms is None:
        return 0.0
    return rtt_ms.get((src, dst), rtt_ms.get((dst, src), 0.0))
