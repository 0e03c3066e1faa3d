"""Per-request routing over servers with cache slots: the shared part of PETALS, BPRR and Helix-style.

A path policy picks a server path for each arriving request (its own rule); the request then takes the m_ij cache
slots it needs server by server, in path order, as a Petals client opens its sessions along the chain: it holds
the slots it got while it waits for the next server (hold and wait). Each server hands out slots in arrival order,
as Petals' memory cache does under its allocation lock: once a request waits at a server, later requests wait
behind it there. The request starts once it holds slots on every server of its path.

Paths only move forward in blocks, so servers are ordered by their last block and a request holds only servers
before the one it waits at: no cycle of waiting requests can form. A path is never chosen through a server whose
total slots are fewer than the path needs there, so every request eventually starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.dispatch_policy import (
    SLOT_SLACK,
    NoFeasiblePlan,
    Route,
    Start,
    path_service_time_ms,
    server_slots,
)
from orchestrator.swarm_model import Placement, SwarmModel

# cost of entering server j processing `count` blocks there; math.inf forbids the link
LinkCost = Callable[[str, int], float]


@dataclass(frozen=True)
class Hop:
    """A server that may follow `previous` (None: the dummy start server) and the blocks it then processes."""

    previous: str | None
    blocks: int


class PlacementGraph:
    """The routing DAG of a placement: who may follow whom, with shortest paths by dynamic programming.

    Servers are processed in order of their last block, which strictly increases along every link, so one pass
    over that order finds the shortest path for any non-negative link cost in O(links).
    """

    def __init__(self, swarm: SwarmModel, placement: Placement) -> None:
        self.swarm = swarm
        self.placement = placement
        self.blocks = swarm.model.blocks
        hosts = placement.hosting()
        self.last_block = {name: placement.first_block(name) + placement.num_blocks(name) - 1 for name in hosts}
        self.order = sorted(hosts, key=lambda name: (self.last_block[name], name))
        self.hops: dict[str, list[Hop]] = {}
        for name in self.order:
            first, last = placement.first_block(name), self.last_block[name]
            hops = [Hop(None, last)] if first == 1 else []
            for previous in self.order:
                previous_last = self.last_block[previous]
                if first <= previous_last + 1 <= last:
                    hops.append(Hop(previous, last - previous_last))
            self.hops[name] = hops
        self.exits = [name for name in self.order if self.last_block[name] == self.blocks]

    def shortest_path(self, cost: LinkCost) -> tuple[tuple[str, ...], float] | None:
        """Gives the cheapest path from block 1 to block L and its cost, or None if no finite path exists."""
        distance: dict[str, float] = {}
        parent: dict[str, str | None] = {}
        for name in self.order:
            best, best_parent = math.inf, None
            for hop in self.hops[name]:
                base = 0.0 if hop.previous is None else distance.get(hop.previous, math.inf)
                if base == math.inf:
                    continue
                total = base + cost(name, hop.blocks)
                if total < best:
                    best, best_parent = total, hop.previous
            if best < math.inf:
                distance[name], parent[name] = best, best_parent
        reachable = [name for name in self.exits if name in distance]
        if not reachable:
            return None
        end = min(reachable, key=lambda name: (distance[name], self.order.index(name)))
        path = [end]
        while parent[path[-1]] is not None:
            path.append(parent[path[-1]])  # type: ignore[arg-type]
        return tuple(reversed(path)), distance[end]

    def route(self, servers: tuple[str, ...]) -> Route:
        """Gives the route along `servers`: blocks per hop and the mean service time."""
        counts, last = [], 0
        for name in servers:
            counts.append(self.last_block[name] - last)
            last = self.last_block[name]
        return Route(servers, tuple(counts), path_service_time_ms(self.swarm, servers, counts))


class PathPolicy:
    """Base of per-request routing policies: FIFO-per-server waiting for cache slots, and slot bookkeeping."""

    name = "path"

    def __init__(self, swarm: SwarmModel, placement: Placement, job_units: Callable[[int], float] | None = None
                 ) -> None:
        self.swarm = swarm
        self.placement = placement
        self.chains: tuple = ()
        self.graph = PlacementGraph(swarm, placement)
        self.slots_total = server_slots(swarm, placement)
        self.slots_free: dict[str, float] = dict(self.slots_total)
        # a job's KV per block as a share of s_c (`Workload.units`); default: every job holds s_c
        self.job_units: Callable[[int], float] = job_units or (lambda job: 1.0)
        self._waiting: list[_Waiting] = []
        self._running: dict[int, Route] = {}
        probe = self.graph.shortest_path(self.base_cost)
        if probe is None:
            raise NoFeasiblePlan("the placement leaves no path through blocks 1..L with enough cache slots")

    def holds(self, job: int, count: int) -> float:
        """Gives the slots `job` holds on a server where it runs `count` blocks."""
        return count * self.job_units(job)

    def base_cost(self, name: str, count: int) -> float:
        """Gives the link cost with no load: tau_c[j] + tau_p[j] * m_ij, or inf where j can never hold the job."""
        if count > self.slots_total[name]:
            return math.inf
        server = self.swarm.server(name)
        return server.tau_c_ms + server.tau_p_ms * count

    def choose(self, job: int, now_ms: float) -> Route:
        """Gives the route for a new request; subclasses implement their routing rule."""
        raise NotImplementedError

    def started(self, job: int, route: Route, now_ms: float) -> None:
        """Hook: `job` took its slots at `now_ms`."""

    def finished(self, job: int, route: Route, now_ms: float) -> None:
        """Hook: `job` released its slots at `now_ms`."""

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def arrive(self, job: int, now_ms: float) -> list[Start]:
        self._waiting.append(_Waiting(job, self.choose(job, now_ms)))
        return self._drain(now_ms)

    def complete(self, job: int, now_ms: float) -> list[Start]:
        self._release(job, now_ms)
        return self._drain(now_ms)

    def _release(self, job: int, now_ms: float) -> None:
        """Gives `job`'s slots back to its servers."""
        route = self._running.pop(job)
        for name, count in zip(route.servers, route.blocks_per_server, strict=True):
            self.slots_free[name] += self.holds(job, count)
        self.finished(job, route, now_ms)

    def _begin(self, job: int, route: Route, now_ms: float) -> Start:
        """Notes that `job`, holding its slots on every server of `route`, starts now."""
        self._running[job] = route
        self.started(job, route, now_ms)
        return Start(job, route)

    def _drain(self, now_ms: float) -> list[Start]:
        """Lets waiting requests take slots in arrival order; gives those that now hold their whole path."""
        starts: list[Start] = []
        queued_at: set[str] = set()  # servers where an earlier request is waiting: later ones queue behind it
        still_waiting: list[_Waiting] = []
        for waiting in self._waiting:
            route = waiting.route
            while waiting.held < len(route.servers):
                name = route.servers[waiting.held]
                need = self.holds(waiting.job, route.blocks_per_server[waiting.held])
                if name in queued_at or self.slots_free[name] < need - SLOT_SLACK:
                    queued_at.add(name)
                    break
                self.slots_free[name] -= need
                waiting.held += 1
            if waiting.held < len(route.servers):
                still_waiting.append(waiting)
                continue
            starts.append(self._begin(waiting.job, route, now_ms))
        self._waiting = still_waiting
        return starts


@dataclass
class _Waiting:
    """A routed request that does not hold slots on every server of its path yet; `held` servers it does."""

    job: int
    route: Route
    held: int = 0
