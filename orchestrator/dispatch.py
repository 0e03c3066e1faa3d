"""Dispatch: JFFC, Join-the-Fastest-Free-Chain (Alg. 3 of the chain-composition paper), with one central queue.

An arriving job starts on the fastest chain that runs fewer jobs than its capacity, or waits in one FIFO queue;
when a job completes on a chain, the head of the queue starts on that chain. Jobs never migrate. The free
chains sit in a heap keyed by their speed rank, so each event costs O(log K).

Standby chains (our extension, for KV packing): chains through a server that the packing keeps as a standby
(`set_standby`) take a job only when no other chain has a free slot, so that JFFC does not undo what MELL packs;
among either kind the ranking is the same.

Load-aware ranking (our extension; the paper's model has none): where servers announce how their per-block time
grows with the jobs they batch (`ServerSpec.tau_p_batch_ms`), "fastest" is the service time a job would see now:
T_k plus, per server of the chain, m_ij * tau_p_batch[j] * (jobs the server runs). A chain that already batches
many jobs can then be slower than an idle slower one, and the job goes there. Capacities, the queue and the
completions are as in Alg. 3. Without slopes the ranking is the paper's, and it is the heap's; with them, an arrival
scans the free chains (O(K x hops)).

`JFFC` is the dispatcher itself; `JFFCPolicy` puts it behind the `DispatchPolicy` interface the simulator drives. The
live orchestrator and the simulator both use `JFFC` from here.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Mapping, Sequence

from orchestrator.dispatch_policy import Route, Start, batch_slopes, loaded_service_time_ms
from orchestrator.swarm_model import Chain, Placement, SwarmModel


class JFFC:
    """Join-the-Fastest-Free-Chain over fixed chains; jobs are opaque hashable values (not None) owned by the caller.

    Chains of equal rate are ranked by index (the lowest first), so every decision is deterministic. With
    `batch_slopes` (server -> tau_p growth per other job, ms per block) chains rank by their loaded service time.
    """

    def __init__(self, chains: Sequence[Chain], batch_slopes: Mapping[str, float] | None = None) -> None:
        self._chains = list(chains)
        self._slopes = {name: slope for name, slope in (batch_slopes or {}).items() if slope > 0}
        self._server_jobs: Counter[str] = Counter()  # jobs each server runs, over all chains
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
        self._standby: frozenset[int] = frozenset()

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

    def service_time_ms(self, chain_index: int) -> float:
        """Gives the service time a job starting on chain `chain_index` now would see: T_k, plus the batching
        slowdown of the jobs its servers already run (with `batch_slopes`)."""
        chain = self._chains[chain_index]
        if not self._slopes:
            return chain.service_time_ms
        return loaded_service_time_ms(chain.service_time_ms, chain.servers, chain.blocks_per_server, self._slopes,
                                      self._server_jobs)

    def set_standby(self, chain_indices: Iterable[int]) -> None:
        """Makes these chains the last resort: they take a job only when no other chain has a free slot."""
        self._standby = frozenset(chain_indices)

    def _fastest_free(self) -> int:
        if not self._slopes and not self._standby:
            return self._chain_of_rank[self._free_ranks[0]]

        def key(rank: int) -> tuple[bool, float, int]:
            index = self._chain_of_rank[rank]
            return index in self._standby, self.service_time_ms(index), rank

        return self._chain_of_rank[min(self._free_ranks, key=key)]

    def _count(self, chain_index: int, jobs: int) -> None:
        self._busy[chain_index] += jobs
        self._running += jobs
        for name in self._chains[chain_index].servers:
            self._server_jobs[name] += jobs

    def arrive(self, job: Hashable) -> int | None:
        """Gives the chain `job` starts on now (the fastest with a free slot), or None when it joins the queue.

        `job` must not be None: `complete` gives None for "no queued job starts".
        """
        if job is None:
            raise ValueError("a job cannot be None: complete() gives None when no queued job starts")
        if not self._free_ranks:
            self._queue.append(job)
            return None
        index = self._fastest_free()
        self._count(index, 1)
        if self._busy[index] == self._capacities[index]:
            self._take_rank(index)
        return index

    def _take_rank(self, chain_index: int) -> None:
        """Takes a chain that just filled off the free heap (the top in O(log K), as the paper's rule takes it)."""
        rank = self._rank_of_chain[chain_index]
        if self._free_ranks[0] == rank:
            heapq.heappop(self._free_ranks)
        else:
            self._free_ranks.remove(rank)
            heapq.heapify(self._free_ranks)

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
        self._count(chain_index, 1)
        if self._busy[chain_index] == self._capacities[chain_index]:
            self._take_rank(chain_index)

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
        self._count(chain_index, -1)
        return None


class JFFCPolicy:
    """Join-the-Fastest-Free-Chain over fixed chains with one central FIFO queue; load-aware when `swarm`'s servers
    have batch slopes."""

    def __init__(self, chains: Sequence[Chain], placement: Placement, name: str = "jffc",
                 swarm: SwarmModel | None = None) -> None:
        if not chains:
            raise ValueError("JFFC needs at least one chain")
        self.name = name
        self.placement = placement
        self.chains = tuple(chains)
        self._routes = [Route.of_chain(chain, index) for index, chain in enumerate(self.chains)]
        self._dispatcher = JFFC(list(self.chains), batch_slopes(swarm) if swarm is not None else None)
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
