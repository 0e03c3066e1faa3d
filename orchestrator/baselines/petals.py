"""PETALS baseline: Petals' block selection as servers join, and min-latency routing that waits for cache.

Placement (Petals `choose_num_blocks` / `block_selection`), with servers joining in a random order:
- m_j = min(floor(M_j / (s_m + s_c * cache_jobs)), L): a Petals server reserves attention cache for a fixed number
  of tokens per block (`attn_cache_tokens`, 4096 for BLOOM = 2 sessions of 2048 tokens), not for the load;
- its start block is the window whose sorted per-block throughputs are lexicographically smallest (ties: the
  lowest start), where a block's throughput is the sum over the servers hosting it;
- a server's throughput is Petals' min(network rps, compute rps / average blocks used), here
  min(1 / tau_c[j], 2 / (tau_p[j] * (1 + m_j))) jobs per ms.
Its cache then is all memory left after the parameters (Mtilde_j), as in every policy here.

Routing: per request, the path of least estimated latency. As in Petals' `_build_inference_graph` (and the spec),
a link into j costs RTT_j / 2 + overhead + tau_p[j] * m_ij, the one-way delay Petals estimates from its pings plus
its 18 ms `overhead_delay`, plus a penalty (Petals' 10 s `alloc_delay`) where j has fewer free slots than the
request needs now. Here tau_c[j] = RTT_j + 18 ms, so the router sees RTT_j = tau_c[j] - 18 ms; the job then takes
the true tau_c[j] per hop (the orchestrator relays), so Petals' estimate undercounts a hop's network time, as it
would in that setting. The request waits on its path until its servers have room (`PathPolicy`). Idealizations in
PETALS' favour: the router sees the true free slots at once (Petals reads them from DHT records that lag) and asks
for m_ij slots (Petals checks the server's whole span). Petals' periodic rebalancing of servers is not modelled.

"petals-retry" routes the same way but waits as Petals' client (and ours) does, not on its path: a request whose
route has a server without room holds nothing and tries again after an exponential backoff (first `backoff_ms`,
doubling up to `max_backoff_ms`), routing afresh each time; a slot that frees goes to whoever asks first, not to
the oldest request; with `record_period_ms` it routes on free slots as the servers' periodic records last announced
them. This is the PETALS that `benchmarks/table1.py` runs live.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import numpy as np

from orchestrator.baselines.path_routing import PathPolicy
from orchestrator.dispatch_policy import SLOT_SLACK, NoFeasiblePlan, Route, Start
from orchestrator.placement import blocks_for_capacity
from orchestrator.swarm_model import Placement, SwarmModel

PETALS_CACHE_JOBS = 2  # attn_cache_tokens 4096 / max sequence 2048 (BLOOM has no grouped-query attention)
PETALS_ALLOC_PENALTY_MS = 10_000.0
PETALS_OVERHEAD_MS = 18.0  # Petals' overhead_delay (serialization), also the 18 ms in tau_c = RTT + 18 ms
RETRY_BACKOFF_MS, RETRY_MAX_BACKOFF_MS = 500.0, 8000.0  # the client's backoff (benchmarks/table1_client.py)


def petals_server_throughput(tau_c_ms: float, tau_p_ms: float, blocks: int) -> float:
    """Gives Petals' throughput estimate of a server hosting `blocks` blocks, in jobs per ms per block."""
    network = math.inf if tau_c_ms <= 0 else 1.0 / tau_c_ms
    return min(network, 2.0 / (tau_p_ms * (1 + blocks)))


def choose_best_start(throughputs: list[float], blocks: int) -> int:
    """Gives the 1-based start whose window has the lexicographically smallest sorted throughputs (Petals)."""
    options = ((sorted(throughputs[i : i + blocks]), i) for i in range(len(throughputs) - blocks + 1))
    return min(options)[1] + 1


def petals_placement(swarm: SwarmModel, rng: np.random.Generator, cache_jobs: int = PETALS_CACHE_JOBS) -> Placement:
    """Gives the placement Petals servers reach when they join one by one in a random order."""
    model = swarm.model
    per_block = [0.0] * model.blocks
    blocks: dict[str, tuple[int, int]] = {}
    for index in rng.permutation(len(swarm.servers)):
        server = swarm.servers[int(index)]
        count = blocks_for_capacity(server, model, cache_jobs)
        if count <= 0:
            blocks[server.name] = (0, 0)
            continue
        start = choose_best_start(per_block, count)
        blocks[server.name] = (start, count)
        rate = petals_server_throughput(server.tau_c_ms, server.tau_p_ms, count)
        for block in range(start - 1, start - 1 + count):
            per_block[block] += rate
    if min(per_block) <= 0:
        raise NoFeasiblePlan("PETALS: the servers' memory does not cover every block")
    return Placement(blocks)


def petals_link_estimate_ms(
    tau_c_ms: float, tau_p_ms: float, blocks: int, overhead_ms: float = PETALS_OVERHEAD_MS
) -> float:
    """Gives Petals' latency estimate of a link into a server: RTT / 2 + overhead + tau_p m_ij."""
    # the model folds the overhead into tau_c = RTT + overhead; Petals estimates from the RTT it pings
    rtt_ms = max(tau_c_ms - overhead_ms, 0.0)
    return rtt_ms / 2.0 + overhead_ms + tau_p_ms * blocks


class PetalsRouting(PathPolicy):
    """Min-latency routing with Petals' estimates and its penalty for servers whose cache is full; waits for cache."""

    name = "petals"

    def __init__(
        self,
        swarm: SwarmModel,
        placement: Placement,
        penalty_ms: float = PETALS_ALLOC_PENALTY_MS,
        overhead_ms: float = PETALS_OVERHEAD_MS,
        job_units: Callable[[int], float] | None = None,
    ) -> None:
        self.penalty_ms = penalty_ms
        self.overhead_ms = overhead_ms
        super().__init__(swarm, placement, job_units)

    def estimate_ms(self, name: str, count: int) -> float:
        """Gives Petals' estimated latency of entering `name` for `count` blocks, before any cache penalty."""
        if count > self.slots_total[name]:
            return math.inf  # a job could never fit there
        server = self.swarm.server(name)
        return petals_link_estimate_ms(server.tau_c_ms, server.tau_p_ms, count, self.overhead_ms)

    def free_seen(self, name: str) -> float:
        """Gives the free slots of `name` as the router sees them (here: as they are)."""
        return self.slots_free[name]

    def choose(self, job: int, now_ms: float) -> Route:
        def cost(name: str, count: int) -> float:
            base = self.estimate_ms(name, count)
            return base + (self.penalty_ms if self.free_seen(name) < self.holds(job, count) - SLOT_SLACK else 0.0)

        found = self.graph.shortest_path(cost)
        assert found is not None  # the constructor checked that a path exists
        return self.graph.route(found[0])


class PetalsRetry(PetalsRouting):
    """PETALS whose requests wait as its clients do: a request that finds no room on its route holds nothing and
    routes again after an exponential backoff (a `Waking` policy).

    With `record_period_ms`, the router sees each server's free slots as its latest record announced them: server
    k of n announces at k / n of the period, then every period (as live servers re-announce periodically), so
    requests that arrive between two announcements may all pick a server that has filled since, and back off."""

    name = "petals-retry"

    def __init__(
        self, swarm: SwarmModel, placement: Placement, backoff_ms: float = RETRY_BACKOFF_MS,
        max_backoff_ms: float = RETRY_MAX_BACKOFF_MS, job_units: Callable[[int], float] | None = None,
        record_period_ms: float = 0.0,
    ) -> None:
        if not 0 < backoff_ms <= max_backoff_ms:
            raise ValueError(f"backoff must satisfy 0 < first ({backoff_ms}) <= max ({max_backoff_ms})")
        if record_period_ms < 0:
            raise ValueError(f"record_period_ms must be >= 0, got {record_period_ms}")
        super().__init__(swarm, placement, job_units=job_units)
        self.backoff_ms, self.max_backoff_ms = backoff_ms, max_backoff_ms
        self.record_period_ms = record_period_ms
        self._retries: list[tuple[float, int, int]] = []  # (when, job, attempts so far)
        names = sorted(self.slots_free)
        self._phase_ms = {name: record_period_ms * k / len(names) for k, name in enumerate(names)}
        self._announced = {name: (self.slots_free[name], -math.inf) for name in names}  # (free slots, when)

    @property
    def waiting(self) -> int:
        return len(self._retries)

    def free_seen(self, name: str) -> float:
        return self._announced[name][0] if self.record_period_ms > 0 else self.slots_free[name]

    def _announce(self, now_ms: float) -> None:
        """Takes in the records announced since the last event: slots change only at events, so a record announced
        between the last event and now carries the slots free now."""
        if self.record_period_ms <= 0:
            return
        for name, (_, when) in self._announced.items():
            phase = self._phase_ms[name]
            latest = phase + math.floor((now_ms - phase) / self.record_period_ms) * self.record_period_ms
            if latest > when:
                self._announced[name] = (self.slots_free[name], latest)

    def arrive(self, job: int, now_ms: float) -> list[Start]:
        self._announce(now_ms)
        return self._attempt(job, 0, now_ms)

    def complete(self, job: int, now_ms: float) -> list[Start]:
        self._announce(now_ms)
        self._release(job, now_ms)
        return []  # nobody is handed the freed slots: the next request to try takes them

    def next_wake_ms(self) -> float | None:
        return self._retries[0][0] if self._retries else None

    def wake(self, now_ms: float) -> list[Start]:
        self._announce(now_ms)
        starts: list[Start] = []
        while self._retries and self._retries[0][0] <= now_ms:
            _, job, attempts = heapq.heappop(self._retries)
            starts += self._attempt(job, attempts, now_ms)
        return starts

    def _attempt(self, job: int, attempts: int, now_ms: float) -> list[Start]:
        route = self.choose(job, now_ms)
        if any(self.slots_free[name] < self.holds(job, count) - SLOT_SLACK
               for name, count in zip(route.servers, route.blocks_per_server, strict=True)):
            delay_ms = min(self.max_backoff_ms, self.backoff_ms * 2**attempts)
            heapq.heappush(self._retries, (now_ms + delay_ms, job, attempts + 1))
            return []
        for name, count in zip(route.servers, route.blocks_per_server, strict=True):
            self.slots_free[name] -= self.holds(job, count)
        return [self._begin(job, route, now_ms)]


def petals(swarm: SwarmModel, rng: np.random.Generator, job_units: Callable[[int], float] | None = None
           ) -> PetalsRouting:
    """Gives the PETALS baseline: random join order placement and min-latency routing (servers admit each job by
    its `job_units` of KV when given, else by s_c)."""
    return PetalsRouting(swarm, petals_placement(swarm, rng), job_units=job_units)


def petals_retry(swarm: SwarmModel, rng: np.random.Generator, backoff_ms: float = RETRY_BACKOFF_MS,
                 max_backoff_ms: float = RETRY_MAX_BACKOFF_MS, job_units: Callable[[int], float] | None = None
                 ) -> PetalsRetry:
    """Gives PETALS with its clients' retries: the same placement, requests back off and route again."""
    return PetalsRetry(swarm, petals_placement(swarm, rng), backoff_ms, max_backoff_ms, job_units)
