"""Load balancing over fixed chains, each chain with its own FIFO queue: JSQ, JIQ, SED, SA-JSQ (Fig. 5a baselines).

Z_l counts the jobs at chain l (running and queued there); a chain runs at most c_l of them and queues the rest.
A job never moves to another chain. Metrics follow `shared/specs/chain-composition.md`, extended to parallel
processing as the paper does:
  JSQ     argmin (Z_l - c_l + 1)^+ / c_l, random ties;
  SA-JSQ  the same metric, ties to the largest mu_l (then random);
  SED     argmin 1/mu_l + (Z_l - c_l + 1)^+ / (mu_l c_l), random ties;
  JIQ     a random chain with Z_l < c_l, else a uniformly random chain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from orchestrator.dispatch_policy import Route, Start
from orchestrator.swarm_model import Chain, Placement

RULES = ("jsq", "jiq", "sed", "sa-jsq")


class DedicatedQueues:
    """Dispatches each arrival to one chain by `rule`; each chain serves its own queue FIFO."""

    def __init__(self, chains: Sequence[Chain], placement: Placement, rule: str, rng: np.random.Generator) -> None:
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; choose from {', '.join(RULES)}")
        if not chains:
            raise ValueError("load balancing needs at least one chain")
        self.name = rule
        self.placement = placement
        self.chains = tuple(chains)
        self._rule = rule
        self._rng = rng
        self._routes = [Route.of_chain(chain, index) for index, chain in enumerate(self.chains)]
        self._capacity = np.array([chain.capacity for chain in self.chains], dtype=np.int64)
        self._rate = np.array([chain.rate_per_ms for chain in self.chains])
        self._jobs = np.zeros(len(self.chains), dtype=np.int64)  # Z_l: running + queued on chain l
        self._queues: list[deque[int]] = [deque() for _ in self.chains]
        self._chain_of: dict[int, int] = {}

    def arrive(self, job: int, now_ms: float) -> list[Start]:
        index = self._choose()
        self._chain_of[job] = index
        self._jobs[index] += 1
        if self._jobs[index] <= self._capacity[index]:
            return [Start(job, self._routes[index])]
        self._queues[index].append(job)
        return []

    def complete(self, job: int, now_ms: float) -> list[Start]:
        index = self._chain_of.pop(job)
        self._jobs[index] -= 1
        if self._queues[index]:
            return [Start(self._queues[index].popleft(), self._routes[index])]
        return []

    def _choose(self) -> int:
        backlog = np.maximum(self._jobs - self._capacity + 1, 0)
        if self._rule == "jiq":
            idle = np.flatnonzero(self._jobs < self._capacity)
            pool = idle if idle.size else np.arange(len(self.chains))
            return int(self._rng.choice(pool))
        if self._rule == "sed":
            score = 1.0 / self._rate + backlog / (self._rate * self._capacity)
        else:
            score = backlog / self._capacity
        best = np.flatnonzero(np.isclose(score, score.min(), rtol=1e-12, atol=0.0))
        if self._rule == "sa-jsq":
            fastest = self._rate[best].max()
            best = best[self._rate[best] == fastest]
        return int(best[0]) if best.size == 1 else int(self._rng.choice(best))
