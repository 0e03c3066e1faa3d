"""How long a started job runs in the simulator: a fixed service time, or one that its servers' batches stretch.

`FixedService` is the paper's model: a job of size s on a route of service time T ends s * T after it starts,
whatever else runs. `SharedService` is the batching engine's, a fluid model in two phases:
- prefill: the engine lets one prompt chunk into each batch (its token budget), so the jobs prefilling on a server
  at once take turns: with n of them on server j, a job's prompt advances n times slower there. Alone, the phase
  takes p * sum_j m_ij * tau_p_prefill[j], p the job's prompt over the mean job's (`ServerSpec.tau_p_prefill_ms`);
- decode: the rest of its time alone (s * T less the prefill), plus, per hop, m_ij * tau_p_batch[j] * s for each
  other job decoding on j (their rows share its batches: `ServerSpec.tau_p_batch_ms`).
Between two events every running job advances at the rate its phase's present time gives (a fraction 1 / time of
the phase per ms), recomputed at every start, phase change and end. Without prefill shares and slopes both clocks
give the same times.

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

    def start(self, job: int, route: Route, size: float, now_ms: float, prompt: float | None = None) -> None:
        """Starts `job` of `size` (and prompt `prompt`, relative to the mean job's; None: `size`) on `route`."""
        ...

    def next_end_ms(self) -> float:
        """Gives when the next running job ends or changes phase (inf when none runs)."""
        ...

    def finish(self) -> tuple[float, int | None]:
        """Ends the job that ends next, or moves it to its next phase; gives (the time, the job that ended, or None
        for a phase change)."""
        ...


class FixedService:
    """The paper's model: a job ends size x its route's service time after it starts."""

    def __init__(self) -> None:
        self._ends: list[tuple[float, int, int]] = []
        self._order = 0

    def start(self, job: int, route: Route, size: float, now_ms: float, prompt: float | None = None) -> None:
        heapq.heappush(self._ends, (now_ms + size * route.service_time_ms, self._order, job))
        self._order += 1

    def next_end_ms(self) -> float:
        return self._ends[0][0] if self._ends else math.inf

    def finish(self) -> tuple[float, int | None]:
        end, _, job = heapq.heappop(self._ends)
        return end, job


@dataclass
class _Running:
    route: Route
    size: float
    order: int
    prefill_ms: list[float]  # per hop, the prompt's prefill alone; empty once the job decodes
    decode_ms: float  # the rest of the job alone
    left: float = 1.0  # the fraction of the present phase still to do
    rate_per_ms: float = 0.0

    @property
    def prefilling(self) -> bool:
        return bool(self.prefill_ms)


class SharedService:
    """Jobs whose speed depends on what each of their servers runs besides (a fluid model of batching)."""

    def __init__(self, swarm: SwarmModel) -> None:
        self._slopes = batch_slopes(swarm)
        self._prefill = {server.name: server.tau_p_prefill_ms for server in swarm.servers}
        self._running: dict[int, _Running] = {}
        self._prefilling: Counter[str] = Counter()  # server -> jobs in their prefill there
        self._decoding: Counter[str] = Counter()  # server -> jobs in their decode there
        self._now_ms = 0.0
        self._order = 0

    def start(self, job: int, route: Route, size: float, now_ms: float, prompt: float | None = None) -> None:
        self._advance(now_ms)
        prompt = size if prompt is None else prompt
        hops = [prompt * count * self._prefill.get(name, 0.0)
                for name, count in zip(route.servers, route.blocks_per_server, strict=True)]
        prefill = hops if sum(hops) > 0 else []
        running = _Running(route, size, self._order, prefill, max(0.0, size * route.service_time_ms - sum(hops)))
        self._running[job] = running
        self._order += 1
        (self._prefilling if running.prefilling else self._decoding).update(route.servers)
        self._rerate()

    def next_end_ms(self) -> float:
        job = self._next()
        return math.inf if job is None else self._end_ms(self._running[job])

    def finish(self) -> tuple[float, int | None]:
        job = self._next()
        if job is None:
            raise ValueError("no job runs")
        running = self._running[job]
        end_ms = self._end_ms(running)
        self._advance(end_ms)
        if running.prefilling:
            self._prefilling.subtract(running.route.servers)
            self._decoding.update(running.route.servers)
            running.prefill_ms, running.left = [], 1.0
            self._rerate()
            return end_ms, None
        del self._running[job]
        self._decoding.subtract(running.route.servers)
        self._rerate()
        return end_ms, job

    def phase_time_ms(self, running: _Running) -> float:
        """Gives the time `running`'s present phase would take in all at the servers' present loads."""
        route = running.route
        if running.prefilling:
            return sum(alone * self._prefilling[name] for name, alone in zip(route.servers, running.prefill_ms,
                                                                              strict=True))
        others = {name: self._decoding[name] - 1 for name in route.servers}
        return running.decode_ms + running.size * loaded_service_time_ms(0.0, route.servers, route.blocks_per_server,
                                                                         self._slopes, others)

    def _end_ms(self, running: _Running) -> float:
        return self._now_ms + (running.left / running.rate_per_ms if running.rate_per_ms < math.inf else 0.0)

    def _next(self) -> int | None:
        """Gives the running job whose phase ends first (ties: the one started first)."""
        return min(self._running, key=lambda job: (self._end_ms(self._running[job]), self._running[job].order),
                   default=None)

    def _advance(self, now_ms: float) -> None:
        elapsed = now_ms - self._now_ms
        for running in self._running.values():
            running.left = max(0.0, running.left - elapsed * running.rate_per_ms) if running.rate_per_ms < math.inf \
                else 0.0
        self._now_ms = now_ms

    def _rerate(self) -> None:
        for running in self._running.values():
            time_ms = self.phase_time_ms(running)
            running.rate_per_ms = 1.0 / time_ms if time_ms > 0 else math.inf


def service_clock(swarm: SwarmModel) -> ServiceClock:
    """Gives the clock `swarm` needs: shared when any server has a batch slope or a prefill share, else the paper's
    fixed one."""
    shared = batch_slopes(swarm) or any(server.tau_p_prefill_ms > 0 for server in swarm.servers)
    return SharedService(swarm) if shared else FixedService()
