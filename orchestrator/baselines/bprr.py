"""BPRR baseline (Sun et al., Performance Evaluation 170, 102527): CG-BP placement + waiting-aware routing (WS-RR).

CG-BP, for a target concurrency R:
- m_j = min(floor(M_j / (s_m + s_c R)), L); servers in increasing amortized time t~_j = (tau_c + tau_p m_j) / m_j;
- per block a served count C_b and a deficit T_b (initially R times the time of a virtual server slower than all);
- phase 1 (some C_b < R): the window that covers an under-served block with the largest sum of T_b;
- phase 2: the window whose sorted C_b are lexicographically smallest;
- then T_b -= (t_virtual - t~_j) * min((R - C_b)^+, sessions_j) and C_b += sessions_j over the window, where
  sessions_j = floor((M_j - s_m m_j) / (s_c m_j)) jobs fit on j.
R is the BPRR paper's rule: the mean number of requests in service plus one standard deviation,
R = ceil(N + sqrt(max(N, 1))) with N = lambda * T (Little; T the fastest path with R = 1), capped by the paper's
upper bound floor((sum M_j - s_m (L + J)) / (s_c (L + J))).

WS-RR: per request, the shortest path whose link cost adds to tau_c[j] + tau_p[j] m_ij the time until enough cache
frees up at j. The router knows which requests hold or await slots at j, but not their sizes: it expects each to
release at its start plus its path's mean service time (now, if that has passed). The request then waits on its
path until the slots are really free.
"""

from __future__ import annotations

import math

from orchestrator.baselines.path_routing import PathPolicy, PlacementGraph
from orchestrator.dispatch_policy import NoFeasiblePlan, Route
from orchestrator.placement import blocks_for_capacity
from orchestrator.swarm_model import Placement, SwarmModel


def cgbp_placement(swarm: SwarmModel, concurrency: int) -> Placement:
    """Gives the CG-BP placement for target concurrency R = `concurrency`."""
    model, target = swarm.model, concurrency
    counts = {s.name: blocks_for_capacity(s, model, target) for s in swarm.servers}
    amortized = {
        s.name: (s.tau_c_ms + s.tau_p_ms * counts[s.name]) / counts[s.name] for s in swarm.servers if counts[s.name]
    }
    if not amortized:
        raise NoFeasiblePlan(f"BPRR: no server fits a block with R = {concurrency}")
    virtual = max(amortized.values()) + 1.0
    served = [0] * model.blocks
    deficit = [target * virtual] * model.blocks
    blocks: dict[str, tuple[int, int]] = {s.name: (0, 0) for s in swarm.servers}
    for name in sorted(amortized, key=lambda n: (amortized[n], n)):
        count, server = counts[name], swarm.server(name)
        sessions = math.floor((server.memory_gb - model.block_gb * count) / (model.cache_gb * count) + 1e-9)
        windows = range(model.blocks - count + 1)
        if any(c < target for c in served):
            best, start = -math.inf, 0
            for a in windows:
                if any(c < target for c in served[a : a + count]):
                    total = sum(deficit[a : a + count])
                    if total > best:
                        best, start = total, a
        else:
            start = min(windows, key=lambda a: (sorted(served[a : a + count]), a))
        blocks[name] = (start + 1, count)
        for b in range(start, start + count):
            deficit[b] -= (virtual - amortized[name]) * min(max(target - served[b], 0), sessions)
            served[b] += sessions
    hosted = [False] * model.blocks
    for first, count in blocks.values():
        hosted[first - 1 : first - 1 + count] = [True] * count
    if not all(hosted):
        raise NoFeasiblePlan(f"BPRR: CG-BP with R = {concurrency} leaves blocks unhosted")
    return Placement(blocks)


def bprr_concurrency(swarm: SwarmModel, arrival_rate_per_ms: float) -> int:
    """Gives R by the BPRR rule: mean + one standard deviation of the requests in service, within the upper bound."""
    model, count = swarm.model, len(swarm.servers)
    upper = math.floor(
        (sum(s.memory_gb for s in swarm.servers) - model.block_gb * (model.blocks + count))
        / (model.cache_gb * (model.blocks + count))
    )
    graph = PlacementGraph(swarm, cgbp_placement(swarm, 1))
    found = graph.shortest_path(lambda name, blocks: swarm.server(name).tau_c_ms + swarm.server(name).tau_p_ms * blocks)
    if found is None:
        raise NoFeasiblePlan("BPRR: CG-BP with R = 1 leaves no path through every block")
    in_service = arrival_rate_per_ms * found[1]
    return max(1, math.ceil(min(in_service + math.sqrt(max(in_service, 1.0)), max(upper, 1))))


class WaitingAwareRouting(PathPolicy):
    """WS-RR: shortest path with link cost = expected wait for cache at j + tau_c[j] + tau_p[j] m_ij."""

    name = "bprr"

    def __init__(self, swarm: SwarmModel, placement: Placement) -> None:
        super().__init__(swarm, placement)
        # per server: job -> (slots held or awaited, expected release time)
        self._holders: dict[str, dict[int, tuple[int, float]]] = {name: {} for name in self.slots_total}

    def expected_wait_ms(self, name: str, count: int, now_ms: float) -> float:
        """Gives the expected time until `count` slots are free at `name`, from the router's expectations."""
        holders = self._holders[name]
        free = self.slots_total[name] - sum(slots for slots, _ in holders.values())
        if free >= count:
            return 0.0
        for slots, release in sorted(holders.values(), key=lambda item: item[1]):
            free += slots
            if free >= count:
                return max(release - now_ms, 0.0)
        return math.inf

    def choose(self, job: int, now_ms: float) -> Route:
        waits: dict[tuple[str, int], float] = {}

        def cost(name: str, count: int) -> float:
            base = self.base_cost(name, count)
            if base == math.inf:
                return base
            key = (name, count)
            if key not in waits:
                waits[key] = self.expected_wait_ms(name, count, now_ms)
            return base + waits[key]

        found = self.graph.shortest_path(cost)
        assert found is not None
        route = self.graph.route(found[0])
        hops = zip(route.servers, route.blocks_per_server, strict=True)
        expected_start = now_ms + max(waits.get(pair, 0.0) for pair in hops)
        for name, count in zip(route.servers, route.blocks_per_server, strict=True):
            self._holders[name][job] = (count, expected_start + route.service_time_ms)
        return route

    def started(self, job: int, route: Route, now_ms: float) -> None:
        for name, count in zip(route.servers, route.blocks_per_server, strict=True):
            self._holders[name][job] = (count, now_ms + route.service_time_ms)

    def finished(self, job: int, route: Route, now_ms: float) -> None:
        for name in route.servers:
            del self._holders[name][job]


def bprr(swarm: SwarmModel, arrival_rate_per_ms: float) -> WaitingAwareRouting:
    """Gives the BPRR baseline: CG-BP placement for the BPRR-rule R (lowered until feasible), then WS-RR routing."""
    for concurrency in range(bprr_concurrency(swarm, arrival_rate_per_ms), 0, -1):
        try:
            return WaitingAwareRouting(swarm, cgbp_placement(swarm, concurrency))
        except NoFeasiblePlan:
            continue
    raise NoFeasiblePlan("BPRR: no target concurrency R gives a placement with a path through every block")
