"""Dispatch: JFFC, Join-the-Fastest-Free-Chain (Alg. 3 of the chain-composition paper), with one central queue.

An arriving job starts on the fastest chain that runs fewer jobs than its capacity, or waits in one FIFO queue;
when a job completes on a chain, the head of the queue starts on that chain. Jobs never migrate. The free
chains sit in a heap keyed by their speed rank, so each event costs O(log K).

`JFFC` is the dispatcher itself; `JFFCPolicy` puts it behind the `DispatchPolicy` interface the simulator drives. The
live orchestrator and the simulator both use `JFFC` from here.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Sequence

from orchestrator.dispatch_policy import Route, Start
from orchestrator.swarm_model import Chain, Placement


class JFFC:
    """Join-the-Fastest-Free-Chain over fixed chains; jobs are opaque hashable values (not None) owned by the caller.

    Chains of equal rate are ranked by index (the lowest first), so every decision is deterministic.
    """

    def __init__(self, chains: Sequence[Chain]) -> None:
        self._capacities = [chain.capacity for chain in chains]
        if any(capacity < 0 for capacity in self._capacities):
            raise ValueError("chain capacities must be >= 0")
        # rank 0 is the fastest chain; a rank is the heap key of a chain with free capacity
        order = sorted(range(len(chains)), key=lambda index: (-chains[index].rate_per_ms, index))
        self._chain_of_rank = order
        self._rank_of_chain = [0] * len(chains)
        for rank, index in enumerate(order):
            self._rank_of_chain[index] = rank
        self._free_ranks = [rank for rank, index in enumerate(order) if self._capacities[index] > 0]
        heapq.heapify(self._free_ranks)
        self._busy = [0] * len(chains)
        self._running = 0
        self._queue: deque[Hashable] = deque()

    @property
    def num_chains(self) -> int:
        return len(self._capacities)

    @property
    def queue_length(self) -> int:
        """Gives the number of jobs waiting in the central queue."""
        return len(self._queue)

    @property
    def jobs_in_service(self) -> int:
        """Gives the number of jobs running on all chains together."""
        return self._running

    def busy(self, chain_index: int) -> int:
        """Gives Z_k: the jobs running on chain `chain_index`."""
        return self._busy[chain_index]

    def capacity(self, chain_index: int) -> int:
        """Gives c_k: the most jobs chain `chain_index` runs at once."""
        return self._capacities[chain_index]

    def arrive(self, job: Hashable) -> int | None:
        """Gives the chain `job` starts on now (the fastest with a free slot), or None when it joins the queue.

        `job` must not be None: `complete` gives None for "no queued job starts".
        """
        if job is None:
            raise ValueError("a job cannot be None: complete() gives None when no queued job starts")
        if not self._free_ranks:
            self._queue.append(job)
            return None
        index = self._chain_of_rank[self._free_ranks[0]]
        self._busy[index] += 1
        self._running += 1
        if self._busy[index] == self._capacities[index]:
            heapq.heappop(self._free_ranks)
        return index

    def withdraw(self, job: Hashable) -> bool:
        """Takes `job` out of the queue (its client went away before it started); gives whether it was queued."""
        try:
            self._queue.remove(job)
        except ValueError:
            return False
        return True

    def occupy(self, chain_index: int) -> None:
        """Counts a job that already runs on `chain_index` (carried over from a previous plan) in one of its slots;
        a chain already full then runs one more than its capacity, and takes no new job until it is below again."""
        self._busy[chain_index] += 1
        self._running += 1
        if self._busy[chain_index] == self._capacities[chain_index]:
            self._free_ranks.remove(self._rank_of_chain[chain_index])
            heapq.heapify(self._free_ranks)

    def queued(self) -> list[Hashable]:
        """Gives the queued jobs, head first."""
        return list(self._queue)

    def complete(self, chain_index: int) -> Hashable | None:
        """Frees one slot of `chain_index` and gives the queued job that starts there now, or None."""
        if self._busy[chain_index] == 0:
            raise ValueError(f"chain {chain_index} runs no job to complete")
        if self._queue and self._busy[chain_index] <= self._capacities[chain_index]:
            return self._queue.popleft()  # the head takes the freed slot at once: Z_k is unchanged
        if self._busy[chain_index] == self._capacities[chain_index]:
            heapq.heappush(self._free_ranks, self._rank_of_chain[chain_index])
        self._busy[chain_index] -= 1
        self._running -= 1
        return None


class JFFCPolicy:
    """Join-the-Fastest-Free-Chain over fixed chains with one central FIFO queue."""

    def __init__(self, chains: Sequence[Chain], placement: Placement, name: str = "jffc") -> None:
        if not chains:
            raise ValueError("JFFC needs at least one chain")
        self.name = name
        self.placement = placement
        self.chains = tuple(chains)
        self._routes = [Route.of_chain(chain, index) for index, chain in enumerate(self.chains)]
        self._dispatcher = JFFC(list(self.chains))
        self._chain_of: dict[int, int] = {}

    def arrive(self, job: int, now_ms: float) -> list[Start]:
        index = self._dispatcher.arrive(job)
        return [] if index is None else [self._start(job, index)]

    def complete(self, job: int, now_ms: float) -> list[Start]:
        index = self._chain_of.pop(job)
        following = self._dispatcher.complete(index)
        return [] if following is None else [self._start(following, index)]

    def _start(self, job: int, index: int) -> Start:
        self._chain_of[job] = index
        return Start(job, self._routes[index])
