"""The discrete-event engine: drives a `DispatchPolicy` through a workload and times every job.

Events are arrivals (from the workload, in order), completions (from the service clock, `orchestrator.sim.service`:
the paper's fixed service times, or times its servers' batches stretch; ties in start order) and the
wake-ups a `Waking` policy asks for, so a run is a pure function of the policy, the workload and the seed that made
them. At equal times completions go first (a job that ends at t frees its slots for a job arriving at t), then
wake-ups, then arrivals. The engine checks every start: the job has
arrived and not started before, its route covers blocks 1..L in order on the policy's placement and takes the time
its hops take, a route that names a fixed chain is that chain's route, no server holds more cache slots than it has,
and no fixed chain runs more jobs than its capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from orchestrator.dispatch_policy import (
    SLOT_SLACK,
    DispatchPolicy,
    Route,
    Start,
    Waking,
    hop_blocks,
    path_service_time_ms,
    server_slots,
)
from orchestrator.sim.metrics import RunResult
from orchestrator.sim.service import service_clock
from orchestrator.sim.workload import Workload
from orchestrator.swarm_model import SwarmModel

ROUTE_TIME_REL_TOL = 1e-9  # a route's service time may differ from the sum over its hops by this much (rounding)


class CapacityViolation(AssertionError):
    """A policy started a job that does not fit: more slots than a server has, or more jobs than a chain holds."""


class PolicyError(AssertionError):
    """A policy broke the protocol: started a job twice or before it arrived, used a bad route, or stalled."""


@dataclass
class _Ledger:
    """What is running where: slots in use per server and jobs per fixed chain."""

    slots: dict[str, int]
    used: dict[str, float]  # shares of s_c (a job holds its `Workload.units` per block)
    chain_jobs: list[int]


def simulate(policy: DispatchPolicy, workload: Workload, swarm: SwarmModel, *, warmup_jobs: int = 0) -> RunResult:
    """Gives the per-job times and utilizations of one run of `policy` on `workload`."""
    jobs = workload.jobs
    arrivals, sizes = workload.arrivals_ms, workload.sizes
    start = np.full(jobs, np.nan)
    end = np.full(jobs, np.nan)
    chain_of = np.full(jobs, -1, dtype=np.int64)
    slots = server_slots(swarm, policy.placement)
    ledger = _Ledger(slots, dict.fromkeys(slots, 0.0), [0] * len(policy.chains))
    slot_ms = dict.fromkeys(slots, 0.0)
    routes: dict[int, Route] = {}
    checked_routes: set[Route] = set()
    clock = service_clock(swarm)

    def begin(started: list[Start], now: float) -> None:
        for item in started:
            job, route = item.job, item.route
            if not 0 <= job < jobs or job in routes or not np.isnan(start[job]) or arrivals[job] > now:
                raise PolicyError(f"{policy.name}: job {job} started at {now} ms twice, unknown or before arriving")
            _check_route(route, policy, swarm, checked_routes)
            _take(ledger, route, policy, workload.units(job))
            routes[job] = route
            start[job] = now
            chain_of[job] = -1 if route.chain is None else route.chain
            clock.start(job, route, float(sizes[job]), now, workload.prompt(job))

    waking = policy if isinstance(policy, Waking) else None
    next_arrival = 0
    while True:
        arrival = float(arrivals[next_arrival]) if next_arrival < jobs else math.inf
        completion = clock.next_end_ms()
        wake = waking.next_wake_ms() if waking is not None else None
        wake = math.inf if wake is None else wake
        if min(arrival, completion, wake) == math.inf:
            break
        if completion <= min(arrival, wake):
            now, ended = clock.finish()
            if ended is None:  # a job moved on to its decode phase
                continue
            job = ended
            end[job] = now
            route = routes.pop(job)
            for name, count in zip(route.servers, route.blocks_per_server, strict=True):
                slot_ms[name] += count * workload.units(job) * (now - start[job])
            _release(ledger, route, workload.units(job))
            begin(policy.complete(job, now), now)
        elif wake <= arrival:
            assert waking is not None
            begin(waking.wake(wake), wake)
        else:
            begin(policy.arrive(next_arrival, arrival), arrival)
            next_arrival += 1
    if np.isnan(start).any():
        stuck = int(np.isnan(start).sum())
        raise PolicyError(f"{policy.name}: {stuck} jobs never started although every other job finished")
    return RunResult.from_run(policy, workload, start, end, chain_of, slot_ms, slots, warmup_jobs)


def _check_route(route: Route, policy: DispatchPolicy, swarm: SwarmModel, seen: set[Route]) -> None:
    # the whole route is the key: the same servers under another chain index or service time are checked again
    if route in seen:
        return
    if route.chain is not None:
        if not 0 <= route.chain < len(policy.chains):
            raise PolicyError(f"{policy.name}: route names chain {route.chain} of {len(policy.chains)}")
        own = Route.of_chain(policy.chains[route.chain], route.chain)
        if route != own:
            raise PolicyError(f"{policy.name}: route {route} names chain {route.chain}, whose route is {own}")
    try:
        expected = hop_blocks(policy.placement, route.servers, swarm.model.blocks)
    except ValueError as error:
        raise PolicyError(f"{policy.name}: invalid route {route.servers}: {error}") from None
    if expected != route.blocks_per_server:
        raise PolicyError(f"{policy.name}: route {route.servers} holds {route.blocks_per_server}, not {expected}")
    # another summation order of the same hops differs in the last bits, hence the relative tolerance
    service_ms = path_service_time_ms(swarm, route.servers, route.blocks_per_server)
    if not math.isclose(route.service_time_ms, service_ms, rel_tol=ROUTE_TIME_REL_TOL):
        raise PolicyError(
            f"{policy.name}: route {route.servers} claims service time {route.service_time_ms} ms; its hops take "
            f"{service_ms} ms"
        )
    seen.add(route)


def _take(ledger: _Ledger, route: Route, policy: DispatchPolicy, units: float) -> None:
    for name, count in zip(route.servers, route.blocks_per_server, strict=True):
        ledger.used[name] += count * units
        if ledger.used[name] > ledger.slots[name] + SLOT_SLACK:
            raise CapacityViolation(
                f"{policy.name}: server {name} would hold {ledger.used[name]} cache slots; it has {ledger.slots[name]}"
            )
    if route.chain is not None:
        ledger.chain_jobs[route.chain] += 1
        capacity = policy.chains[route.chain].capacity
        if ledger.chain_jobs[route.chain] > capacity:
            raise CapacityViolation(
                f"{policy.name}: chain {route.chain} would run {capacity + 1} jobs; its capacity is {capacity}"
            )


def _release(ledger: _Ledger, route: Route, units: float) -> None:
    for name, count in zip(route.servers, route.blocks_per_server, strict=True):
        ledger.used[name] -= count * units
    if route.chain is not None:
        ledger.chain_jobs[route.chain] -= 1
