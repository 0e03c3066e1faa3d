"""Cache allocation: GCA (Alg. 2 of the chain-composition paper) under any block placement, and slot accounting.

GCA repeatedly takes the fastest chain that still has room for one more job, gives it as many jobs as the
residual cache slots allow, and charges m_ij slots per job to every server j it traverses (after i).

The shortest paths exploit the DAG: a chain only moves forward through the blocks, and what a server j costs
after its predecessor i depends on i only through the boundary b = a_i + m_i (the next block to process):
j then processes m_ij = a_j + m_j - b blocks. So the search runs over block boundaries, not over
servers: edge (b, e) is served by the cheapest server ending at e whose range contains b and that still has
e - b free slots. Only boundaries where some server's range ends can be on a chain, so with B of them (B <= L + 1,
a few dozen under GBP-CR) each chain costs one O(B^2) numpy pass, from the first boundary that changed. Each
(b, e) keeps its candidate servers sorted by cost; since slots only shrink, a server that drops out of (b, e)
never returns, so a pointer skips it for good: O(sum_j m_j log J) for the candidate lists over the whole run.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orchestrator.analysis import total_rate
from orchestrator.swarm_model import Chain, Placement, ServerSpec, SwarmModel


def chain_blocks(placement: Placement, num_blocks: int, servers: Sequence[str]) -> tuple[int, ...]:
    """Gives m_ij for each server of a chain (blocks it processes after its predecessor), or raises ValueError.

    Valid means: the first server hosts block 1, each next server's range contains the block after its
    predecessor's last one and goes further, and the last server hosts block L.
    """
    if not servers:
        raise ValueError("a chain needs at least one server")
    boundary = 1  # the next block to process; the dummy first server "ends" at block 0
    counts = []
    for name in servers:
        first, count = placement.first_block(name), placement.num_blocks(name)
        end = first + count  # one past the server's last block
        if count < 1 or not first <= boundary <= end - 1:
            raise ValueError(f"server {name!r} (blocks {first}..{end - 1}) cannot continue a chain at block {boundary}")
        counts.append(end - boundary)
        boundary = end
    if boundary != num_blocks + 1:
        raise ValueError(f"chain {list(servers)} stops after block {boundary - 1}, not at block {num_blocks}")
    return tuple(counts)


def chain_service_time_ms(swarm: SwarmModel, servers: Sequence[str], blocks: Sequence[int]) -> float:
    """Gives T = sum over the chain's servers of tau_c + tau_p * m_ij, in ms."""
    return sum(swarm.server(name).job_time_ms(count) for name, count in zip(servers, blocks, strict=True))


def make_chain(swarm: SwarmModel, placement: Placement, servers: Sequence[str], capacity: int) -> Chain:
    """Gives the Chain record of a server sequence (validated against the placement) with `capacity` jobs."""
    blocks = chain_blocks(placement, swarm.model.blocks, servers)
    return Chain(tuple(servers), blocks, capacity, chain_service_time_ms(swarm, servers, blocks))


@dataclass(frozen=True)
class SlotUse:
    """One server's cache slots: residual after its blocks (Mtilde_j), held by the chains' capacity, still free."""

    total: int
    used: int

    @property
    def free(self) -> int:
        return self.total - self.used


def slot_use(swarm: SwarmModel, placement: Placement, chains: Sequence[Chain]) -> dict[str, SlotUse]:
    """Gives every server's slot use when each chain runs its full capacity (sum of m_ij c_k), in swarm order."""
    used = {server.name: 0 for server in swarm.servers}
    for chain in chains:
        for name, count in zip(chain.servers, chain.blocks_per_server, strict=True):
            used[name] += count * chain.capacity
    return {
        server.name: SlotUse(placement.residual_slots(swarm, server.name), used[server.name])
        for server in swarm.servers
    }


class _BoundaryGraph:
    """The boundary DAG of one GCA run: candidate servers per edge (b, e), residual slots, current best edges.

    Only boundaries where some server's range ends (plus block 1) can be on a chain, so the DAG keeps just those:
    under GBP-CR's placements that is a few dozen, whatever L and J are.
    """

    def __init__(self, swarm: SwarmModel, placement: Placement) -> None:
        num_blocks = swarm.model.blocks
        unknown = sorted(set(placement.blocks) - {server.name for server in swarm.servers})
        if unknown:
            raise ValueError(f"the placement names servers the swarm does not have: {', '.join(unknown)}")
        self.names: list[str] = []
        self.servers: list[ServerSpec] = []
        self.first: list[int] = []
        self.end: list[int] = []
        self.slots: list[int] = []
        for server in swarm.servers:
            first, count = placement.first_block(server.name), placement.num_blocks(server.name)
            if count == 0:
                continue
            if first < 1 or first + count - 1 > num_blocks:
                raise ValueError(f"server {server.name!r} hosts blocks {first}..{first + count - 1}, outside 1..L")
            self.names.append(server.name)
            self.servers.append(server)
            self.first.append(first)
            self.end.append(first + count)
            self.slots.append(placement.residual_slots(swarm, server.name))
        # node k of the DAG is boundary self.boundaries[k]; node 0 is block 1 (where every chain starts)
        self.boundaries = sorted({1, *self.end})
        self.node_of = {boundary: node for node, boundary in enumerate(self.boundaries)}
        self.target = self.node_of.get(num_blocks + 1)
        size = len(self.boundaries)
        # candidates[e][b]: hosts ending at node e that can take a job arriving at node b, sorted by cost
        self.candidates: list[list[list[int]]] = [[[] for _ in range(size)] for _ in range(size)]
        self.pointer = np.zeros((size, size), dtype=np.int64)
        self.weight = np.full((size, size), math.inf)  # weight[e, b]: the cheapest valid host's cost
        self.best = np.full((size, size), -1, dtype=np.int64)  # best[e, b]: that host
        for host in range(len(self.names)):
            end_node = self.node_of[self.end[host]]
            for node in range(bisect_left(self.boundaries, self.lowest_boundary(host)), end_node):
                self.candidates[end_node][node].append(host)
        for end_node in range(1, size):
            for node in range(end_node):
                hosts = self.candidates[end_node][node]
                if hosts:
                    blocks = self.boundaries[end_node] - self.boundaries[node]
                    hosts.sort(key=lambda host, blocks=blocks: (self.cost(host, blocks), host))
                    self.refresh(end_node, node)
        self.dist = np.full(size, math.inf)
        self.dist[0] = 0.0
        self.parent = np.zeros(size, dtype=np.int64)
        self.dirty_from = 1

    def cost(self, host: int, blocks: int) -> float:
        return self.servers[host].job_time_ms(blocks)

    def lowest_boundary(self, host: int) -> int:
        """Gives the earliest boundary at which `host` can still take a job: it needs end - b <= slots."""
        return max(self.first[host], self.end[host] - self.slots[host])

    def refresh(self, end_node: int, node: int) -> None:
        """Moves edge (node, end_node) to its cheapest host that still has room, or to no host."""
        hosts = self.candidates[end_node][node]
        boundary = self.boundaries[node]
        index = int(self.pointer[end_node, node])
        while index < len(hosts) and self.lowest_boundary(hosts[index]) > boundary:
            index += 1
        self.pointer[end_node, node] = index
        if index < len(hosts):
            self.weight[end_node, node] = self.cost(hosts[index], self.boundaries[end_node] - boundary)
            self.best[end_node, node] = hosts[index]
        else:
            self.weight[end_node, node] = math.inf
            self.best[end_node, node] = -1

    def shortest_path(self) -> list[tuple[int, int]] | None:
        """Gives the cheapest chain as (host, blocks) hops from block 1 to L, or None if there is none."""
        if self.target is None:
            return None
        dist, weight, parent = self.dist, self.weight, self.parent
        for end_node in range(self.dirty_from, len(self.boundaries)):
            candidates = dist[:end_node] + weight[end_node, :end_node]
            node = int(candidates.argmin())  # the first minimum: the earliest boundary wins ties
            dist[end_node] = candidates[node]
            parent[end_node] = node
        self.dirty_from = len(self.boundaries)
        end_node = self.target
        if math.isinf(dist[end_node]):
            return None
        hops = []
        while end_node > 0:
            node = int(parent[end_node])
            hops.append((int(self.best[end_node, node]), self.boundaries[end_node] - self.boundaries[node]))
            end_node = node
        hops.reverse()
        return hops

    def allocate(self, hops: list[tuple[int, int]], capacity: int) -> None:
        """Charges `capacity` jobs to every hop and drops the edges whose host no longer has room."""
        for host, blocks in hops:
            old_lowest = self.lowest_boundary(host)
            self.slots[host] -= blocks * capacity
            end_node = self.node_of[self.end[host]]
            first_node = bisect_left(self.boundaries, old_lowest)
            last_node = min(bisect_left(self.boundaries, self.lowest_boundary(host)), end_node)
            for node in range(first_node, last_node):
                if self.best[end_node, node] == host:
                    self.refresh(end_node, node)
            self.dirty_from = min(self.dirty_from, end_node)


def gca(swarm: SwarmModel, placement: Placement) -> list[Chain]:
    """Gives GCA's chains, fastest first, each with the most jobs the residual slots allow (Alg. 2).

    Works under any placement; no server's slots are ever over-committed (see `slot_use`).
    """
    graph = _BoundaryGraph(swarm, placement)
    chains: list[Chain] = []
    while (hops := graph.shortest_path()) is not None:
        capacity = min(graph.slots[host] // blocks for host, blocks in hops)
        graph.allocate(hops, capacity)
        servers = tuple(graph.names[host] for host, _ in hops)
        blocks = tuple(blocks for _, blocks in hops)
        chains.append(Chain(servers, blocks, capacity, chain_service_time_ms(swarm, servers, blocks)))
    return chains


def total_rate_per_ms(chains: Sequence[Chain]) -> float:
    """Gives nu = sum_k c_k mu_k, the chains' total service rate in jobs per ms (`analysis.total_rate`'s sum)."""
    return total_rate([chain.rate_per_ms for chain in chains], [chain.capacity for chain in chains])
