"""Parallax-style baseline: greedy pipeline layout with water-filling by speed, round-robin over disjoint chains.

Modelled on Parallax's scheduler (GradientHQ), mapped to this swarm model:
- a server's layer capacity is min(floor(0.65 M_j / s_m), L): Parallax nodes host parameters in a fixed share of
  memory (`param_hosting_ratio` 0.65) and keep the rest for KV cache;
- pipelines are built greedily from servers sorted by capacity (largest first), each taking servers until the
  model's L layers fit; look-ahead: when some server alone can finish the pipeline and the others still hold a full
  model, the smallest such server is taken, which keeps large servers for further pipelines;
- inside each pipeline the layers are re-split by water-filling: sum_i min(cap_i, x * speed_i) = L with speed
  1 / tau_p[i], rounded by largest remainders within the caps, contiguous in the pipeline's order;
- each pipeline is a fixed chain; its capacity is what the residual memory allows on its tightest server;
- jobs go round-robin over the chains that have room, else wait in one central FIFO queue.
Servers left over when no further pipeline fits host nothing.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from orchestrator.dispatch_policy import NoFeasiblePlan, Route, Start, path_service_time_ms
from orchestrator.swarm_model import Chain, Placement, ServerSpec, SwarmModel

PARAM_HOSTING_RATIO = 0.65


def layer_capacity(server: ServerSpec, swarm: SwarmModel, ratio: float = PARAM_HOSTING_RATIO) -> int:
    """Gives how many layers a Parallax node hosts: its parameter share of memory, at most L."""
    return min(math.floor(ratio * server.memory_gb / swarm.model.block_gb + 1e-9), swarm.model.blocks)


def greedy_pipelines(swarm: SwarmModel, ratio: float = PARAM_HOSTING_RATIO) -> list[list[ServerSpec]]:
    """Gives disjoint groups of servers, each able to hold all L layers, built greedily with look-ahead."""
    layers = swarm.model.blocks
    capacity = {s.name: layer_capacity(s, swarm, ratio) for s in swarm.servers}
    available = sorted((s for s in swarm.servers if capacity[s.name] > 0), key=lambda s: (-capacity[s.name], s.name))
    pipelines: list[list[ServerSpec]] = []
    while sum(capacity[s.name] for s in available) >= layers:
        pipeline: list[ServerSpec] = []
        remaining = layers
        while remaining > 0:
            total = sum(capacity[s.name] for s in available)
            finishers = [
                i
                for i, s in enumerate(available)
                if capacity[s.name] >= remaining and total - capacity[s.name] >= layers
            ]
            pick = finishers[-1] if finishers else 0  # the smallest finisher keeps larger servers for later
            server = available.pop(pick)
            pipeline.append(server)
            remaining -= capacity[server.name]
        pipelines.append(pipeline)
    return pipelines


def water_fill(caps: Sequence[int], speeds: Sequence[float], layers: int) -> list[int]:
    """Gives layer counts proportional to speed within caps that sum to `layers` (water level by bisection)."""
    if sum(caps) < layers:
        raise ValueError(f"capacity {sum(caps)} cannot hold {layers} layers")
    low, high = 0.0, max(cap / speed for cap, speed in zip(caps, speeds, strict=True))
    for _ in range(100):
        mid = 0.5 * (low + high)
        if sum(min(cap, mid * speed) for cap, speed in zip(caps, speeds, strict=True)) >= layers:
            high = mid
        else:
            low = mid
    target = [min(cap, high * speed) for cap, speed in zip(caps, speeds, strict=True)]
    counts = [min(cap, math.floor(t)) for cap, t in zip(caps, target, strict=True)]
    remaining = layers - sum(counts)
    for i in sorted(range(len(caps)), key=lambda i: (-(target[i] - counts[i]), i)):
        if remaining == 0:
            break
        if counts[i] < caps[i]:
            counts[i] += 1
            remaining -= 1
    for i in range(len(caps)):  # rounding may leave a few layers if remainders were tied at caps
        extra = min(caps[i] - counts[i], remaining)
        counts[i] += extra
        remaining -= extra
    return counts


def parallax_layout(swarm: SwarmModel, ratio: float = PARAM_HOSTING_RATIO) -> tuple[Placement, list[Chain]]:
    """Gives the Parallax-style placement and its disjoint chains with capacities."""
    model = swarm.model
    blocks: dict[str, tuple[int, int]] = {s.name: (0, 0) for s in swarm.servers}
    groups: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
    for pipeline in greedy_pipelines(swarm, ratio):
        caps = [layer_capacity(s, swarm, ratio) for s in pipeline]
        counts = water_fill(caps, [1.0 / s.tau_p_ms for s in pipeline], model.blocks)
        names, used, first = [], [], 1
        for server, count in zip(pipeline, counts, strict=True):
            if count == 0:
                continue
            blocks[server.name] = (first, count)
            names.append(server.name)
            used.append(count)
            first += count
        groups.append((tuple(names), tuple(used)))
    placement = Placement(blocks)
    chains = []
    for names, used in groups:
        capacity = min(placement.residual_slots(swarm, n) // c for n, c in zip(names, used, strict=True))
        if capacity > 0:
            chains.append(Chain(names, used, capacity, path_service_time_ms(swarm, names, used)))
    if not chains:
        raise NoFeasiblePlan("Parallax-style: the servers cannot form one pipeline with room for a job")
    return placement, chains


class RoundRobinQueue:
    """Round-robin over fixed chains that have room; otherwise one central FIFO queue."""

    name = "round-robin"

    def __init__(self, chains: Sequence[Chain], placement: Placement) -> None:
        if not chains:
            raise ValueError("round-robin needs at least one chain")
        self.placement = placement
        self.chains = tuple(chains)
        self._routes = [Route.of_chain(chain, index) for index, chain in enumerate(self.chains)]
        self._busy = [0] * len(self.chains)
        self._next = 0
        self._queue: deque[int] = deque()
        self._chain_of: dict[int, int] = {}

    def arrive(self, job: int, now_ms: float) -> list[Start]:
        count = len(self.chains)
        for step in range(count):
            index = (self._next + step) % count
            if self._busy[index] < self.chains[index].capacity:
                self._next = (index + 1) % count
                return [self._start(job, index)]
        self._queue.append(job)
        return []

    def complete(self, job: int, now_ms: float) -> list[Start]:
        index = self._chain_of.pop(job)
        self._busy[index] -= 1
        return [self._start(self._queue.popleft(), index)] if self._queue else []

    def _start(self, job: int, index: int) -> Start:
        self._busy[index] += 1
        self._chain_of[job] = index
        return Start(job, self._routes[index])


def parallax(swarm: SwarmModel) -> RoundRobinQueue:
    """Gives the Parallax-style baseline policy."""
    placement, chains = parallax_layout(swarm)
    policy = RoundRobinQueue(chains, placement)
    policy.name = "parallax"
    return policy
