"""Helix-style baseline: max-flow over the placement, per-request interleaved weighted round-robin by flow.

Modelled on Helix (ASPLOS'25), mapped to this swarm model, without Helix's MILP placement:
- placement: servers host min(floor(0.65 M_j / s_m), L) layers (the parameter share of memory, as Parallax-style)
  and join fastest first (largest throughput), each on the window of least hosted throughput (ties: lowest start);
- a server's throughput is the jobs it can hold over the time one job spends there,
  (Mtilde_j / m_j) / (tau_c[j] + tau_p[j] m_j) jobs per ms;
- the routing DAG of the placement (source -> servers hosting block 1 -> ... -> servers ending at L -> sink), with
  each server's throughput as its node capacity, gets a maximum flow (networkx, preflow-push);
- each request walks from the source, choosing every next hop by interleaved (smooth) weighted round-robin over
  the out-links with positive flow, weighted by that flow; it then waits on its path for cache (`PathPolicy`).
"""

from __future__ import annotations

import math

import networkx as nx

from orchestrator.baselines.parallax import PARAM_HOSTING_RATIO, layer_capacity
from orchestrator.baselines.path_routing import PathPolicy
from orchestrator.dispatch_policy import NoFeasiblePlan, Route
from orchestrator.swarm_model import Placement, SwarmModel


def server_throughput(swarm: SwarmModel, placement: Placement, name: str) -> float:
    """Gives the jobs per ms a server sustains: concurrent jobs its cache holds over its time per job."""
    server, count = swarm.server(name), placement.num_blocks(name)
    return (placement.residual_slots(swarm, name) / count) / (server.tau_c_ms + server.tau_p_ms * count)


def helix_placement(swarm: SwarmModel, ratio: float = PARAM_HOSTING_RATIO) -> Placement:
    """Gives the flow-balancing placement: fastest servers first, each on the least-served window."""
    model = swarm.model
    counts = {s.name: layer_capacity(s, swarm, ratio) for s in swarm.servers}
    blocks: dict[str, tuple[int, int]] = {s.name: (0, 0) for s in swarm.servers}
    per_block = [0.0] * model.blocks

    def rate(name: str) -> float:
        server, count = swarm.server(name), counts[name]
        slots = math.floor((server.memory_gb - model.block_gb * count) / model.cache_gb + 1e-9)
        return (slots / count) / (server.tau_c_ms + server.tau_p_ms * count)

    for name in sorted((n for n in counts if counts[n] > 0), key=lambda n: (-rate(n), n)):
        count = counts[name]
        start = min(range(model.blocks - count + 1), key=lambda a: (sum(per_block[a : a + count]), a))
        blocks[name] = (start + 1, count)
        for b in range(start, start + count):
            per_block[b] += rate(name)
    if min(per_block) <= 0:
        raise NoFeasiblePlan("Helix-style: the servers' memory does not cover every block")
    return Placement(blocks)


class FlowRouting(PathPolicy):
    """Routes each request hop by hop, by smooth weighted round-robin over the max-flow's out-link flows."""

    name = "helix"

    def __init__(self, swarm: SwarmModel, placement: Placement) -> None:
        super().__init__(swarm, placement)
        # integer node ids: networkx keeps nodes in sets and dicts, and the hash order of strings changes with
        # every interpreter (PYTHONHASHSEED), which would change which of several maximum flows comes out
        index = {name: i for i, name in enumerate(self.graph.order)}
        source, sink = 0, 1

        def node_in(name: str) -> int:
            return 2 + 2 * index[name]

        graph = nx.DiGraph()
        for name in self.graph.order:
            graph.add_edge(node_in(name), node_in(name) + 1, capacity=server_throughput(swarm, placement, name))
            for hop in self.graph.hops[name]:
                if hop.blocks > self.slots_total[name]:
                    continue  # a job could never fit there
                tail = source if hop.previous is None else node_in(hop.previous) + 1
                graph.add_edge(tail, node_in(name))
        for name in self.graph.exits:
            graph.add_edge(node_in(name) + 1, sink)
        self.max_flow, flows = nx.maximum_flow(graph, source, sink)
        if self.max_flow <= 0:
            raise NoFeasiblePlan("Helix-style: the placement carries no flow from block 1 to block L")
        threshold = 1e-12 * self.max_flow
        self.weights: dict[str | None, list[tuple[str, float]]] = {}
        for tail, key in [(source, None)] + [(node_in(n) + 1, n) for n in self.graph.order]:
            out = flows.get(tail, {})
            links = [(self.graph.order[(head - 2) // 2], flow) for head, flow in out.items() if head != sink]
            self.weights[key] = sorted(((n, f) for n, f in links if f > threshold), key=lambda item: index[item[0]])
        self._current = {key: [0.0] * len(links) for key, links in self.weights.items()}

    def _next_hop(self, at: str | None) -> str:
        """Gives the next server after `at` by smooth weighted round-robin (interleaved, proportional to flow)."""
        links, current = self.weights[at], self._current[at]
        total = sum(flow for _, flow in links)
        for i, (_, flow) in enumerate(links):
            current[i] += flow
        pick = max(range(len(links)), key=lambda i: (current[i], -i))
        current[pick] -= total
        return links[pick][0]

    def choose(self, job: int, now_ms: float) -> Route:
        path: list[str] = []
        at: str | None = None
        while at is None or self.graph.last_block[at] < self.graph.blocks:
            at = self._next_hop(at)
            path.append(at)
        return self.graph.route(tuple(path))


def helix(swarm: SwarmModel) -> FlowRouting:
    """Gives the Helix-style baseline policy."""
    return FlowRouting(swarm, helix_placement(swarm))
