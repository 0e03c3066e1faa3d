"""Blocks a server chooses for itself when no orchestrator places it, as Petals' servers do.

Each server has a throughput per hosted block (Petals' estimate, `petals_server_throughput`: with per-block compute
time tau_p and m blocks, 2 / (tau_p (1 + m)) jobs per ms; the network term is left out, a server cannot measure its
clients' links before it serves); a block's throughput is the sum over the servers hosting it, and the swarm's is
that of its slowest block.
- A joining server takes the window of its m blocks whose sorted block throughputs are lexicographically smallest
  (Petals' `choose_best_blocks`): the least served blocks first.
- A serving server moves only when, with itself taken out and placed at its best window again, the swarm's
  throughput would rise by more than a factor 1 / balance_quality (Petals' `should_choose_other_blocks`, default
  0.75). That margin is the hysteresis that keeps servers from chasing each other: after a move that passes it, the
  one that moved back would lower the swarm's throughput.

Pure: spans in, a start block out (0-based, as `--blocks` is written).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator.baselines.petals import choose_best_start, petals_server_throughput

DEFAULT_BALANCE_QUALITY = 0.75


@dataclass(frozen=True)
class HostedSpan:
    """One server's blocks [start, end) and its per-block compute time for one token (ms)."""

    start: int
    end: int
    block_compute_ms: float

    @property
    def throughput(self) -> float:
        """Gives the server's throughput on each of its blocks (jobs per ms, Petals' estimate)."""
        return petals_server_throughput(0.0, max(self.block_compute_ms, 1e-6), self.end - self.start)


def block_throughputs(spans: Mapping[str, HostedSpan], num_blocks: int) -> list[float]:
    """Gives each block's throughput: the sum over the servers hosting it."""
    totals = [0.0] * num_blocks
    for span in spans.values():
        for block in range(max(0, span.start), min(num_blocks, span.end)):
            totals[block] += span.throughput
    return totals


def choose_start(spans: Mapping[str, HostedSpan], num_blocks: int, blocks: int) -> int:
    """Gives the first block (0-based) of the `blocks`-long window a new server should host."""
    if not 0 < blocks <= num_blocks:
        raise ValueError(f"a server hosts 1..{num_blocks} blocks, not {blocks}")
    return choose_best_start(block_throughputs(spans, num_blocks), blocks) - 1


def swarm_throughput(spans: Mapping[str, HostedSpan], num_blocks: int) -> float:
    """Gives the throughput of the swarm's slowest block (0 while a block has no server)."""
    return min(block_throughputs(spans, num_blocks), default=0.0)


def better_start(
    spans: Mapping[str, HostedSpan], num_blocks: int, me: str, *, balance_quality: float = DEFAULT_BALANCE_QUALITY
) -> int | None:
    """Gives the start `me` should move to, or None when staying is within the hysteresis margin."""
    if not 0 < balance_quality <= 1:
        raise ValueError(f"balance_quality must be in (0, 1], got {balance_quality}")
    mine = spans[me]
    others = {peer: span for peer, span in spans.items() if peer != me}
    start = choose_start(others, num_blocks, mine.end - mine.start)
    if start == mine.start:
        return None
    moved = {**others, me: HostedSpan(start, start + mine.end - mine.start, mine.block_compute_ms)}
    before, after = swarm_throughput(spans, num_blocks), swarm_throughput(moved, num_blocks)
    if after <= 0:
        return None
    if before <= 0 or before / after < balance_quality - 1e-9:
        return start
    return None


def blocks_that_fit(memory_bytes: int, block_bytes: int, kv_bytes_per_block: int, num_blocks: int) -> int:
    """Gives how many blocks a server hosts when it chooses: as many as its memory holds, each with `kv_bytes_per_
    block` of room for KV, at most the model's, at least one."""
    per_block = block_bytes + kv_bytes_per_block
    return max(1, min(num_blocks, math.floor(memory_bytes / per_block) if per_block > 0 else num_blocks))
