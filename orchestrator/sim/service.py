"""How long a started job runs in the simulator: a fixed service time, or one that its servers' batches stretch.

`FixedService` is the paper's model: a job of size s on a route of service time T ends s * T after it starts,
whatever else runs. `SharedService` is the batching engine's: a server that runs n jobs computes each one's blocks
at tau_p + (n - 1) * tau_p_batch (`ServerSpec.tau_p_batch_ms`), so a job's speed changes whenever a job starts or
ends on one of its servers. It is a fluid model: between two events every running job advances at the rate its
route's current service time gives (a fraction 1 / (s * T_now) of itself per ms), and the next end is recomputed
at every event. With no slopes both give the same times.

Pure: times come in as arguments; ties end in start order, so runs are deterministic.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from orchestrator.dispatch_policy import Route, batch_slopes, loaded_service_time_ms
from orchestrator.swarm_model import SwarmModel


class ServiceClock(Protocol):
    """The running jobs and when each ends."""

    def start(self, job: int, route: Route, size: float, now_ms: float) -> None:
        """Starts `job` of `size` on `route` at `now_ms`."""
        ...

    def next_end_ms(self) -> float:
        """Gives when the next running job ends (inf when none runs)."""
        ...

    def finish(self) -> tuple[float, int]:
        """Ends the job that ends next; gives (its end time, the job)."""
        ...


class FixedService:
    """The paper's model: a job ends size x its route's service time after it starts."""

    def __init__(self) -> None:
        self._ends: list[tuple[float, int, int]] = []
        self._order = 0

    def start(self, job: int, route: Route, size: float, now_ms: float) -> None:
        heapq.heappush(self._ends, (now_ms + size * route.service_time_ms, self._order, job))
        self._order += 1

    def next_end_ms(self) -> float:
        return self._ends[0][0] if self._ends else math.inf

    def finish(self) -> tuple[float, int]:
        end, _, job = heapq.heappop(self._ends)
        return end, job


@dataclass
class _Running:
    route: Route
    size: float
    order: int
    left: float = 1.0  # the fraction of the job still to do
    rate_per_ms: float = 0.0


class SharedService:
    """Jobs whose speed depends on how many jobs each of their servers runs (a fluid model of batching)."""

    def __init__(self, swarm: SwarmModel) -> None:
        self._slopes = batch_slopes(swarm)
        self._running: dict[int, _Running] = {}
        self._server_jobs: Counter[str] = Counter()
        self._now_ms = 0.0
        self._order = 0

    def start(self, job: int, route: Route, size: float, now_ms: float) -> None:
        self._advance(now_ms)
        self._running[job] = _Running(route, size, self._order)
        self._order += 1
        self._server_jobs.update(route.servers)
        self._rerate()

    def next_end_ms(self) -> float:
        job = self._next()
        return math.inf if job is None else self._end_ms(self._running[job])

    def finish(self) -> tuple[float, int]:
        job = self._next()
        if job is None:
            raise ValueError("no job runs")
        ending = self._running[job]
        end_ms = self._end_ms(ending)
        self._advance(end_ms)
        del self._running[job]
        self._server_jobs.subtract(ending.route.servers)
        self._rerate()
        return end_ms, job

    def service_time_ms(self, running: _Running) -> float:
        """Gives the time `running` would take in all at the servers' present loads."""
        others = {name: self._server_jobs[name] - 1 for name in running.route.servers}
        route = running.route
        return running.size * loaded_service_time_ms(route.service_time_ms, route.servers, route.blocks_per_server,
                                                     self._slopes, others)

    def _end_ms(self, running: _Running) -> float:
        return self._now_ms + running.left / running.rate_per_ms

    def _next(self) -> int | None:
        """Gives the running job that ends first (ties: the one started first)."""
        return min(self._running, key=lambda job: (self._end_ms(self._running[job]), self._running[job].order),
                   default=None)

    def _advance(self, now_ms: float) -> None:
        elapsed = now_ms - self._now_ms
        for running in self._running.values():
            running.left = max(0.0, running.left - elapsed * running.rate_per_ms)
        self._now_ms = now_ms

    def _rerate(self) -> None:
        for running in self._running.values():
            running.rate_per_ms = 1.0 / self.service_time_ms(running)


def service_clock(swarm: SwarmModel) -> ServiceClock:
    """Gives the clock `swarm` needs: shared when any server has a batch slope, else the paper's fixed one."""
    return SharedService(swarm) if batch_slopes(swarm) else FixedService()
