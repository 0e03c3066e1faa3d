"""Block placement: GBP-CR (Alg. 1 of the chain-composition paper) and its per-server quantities.

For a required capacity c, server j reserves c cache slots for every block it hosts, so it holds
m_j(c) = min(floor(M_j / (s_m + s_c c)), L) blocks and takes at most t_j(c) = tau_c[j] + tau_p[j] m_j(c) per job.
GBP-CR sorts servers by the amortized per-block time t_j(c) / m_j(c) and stacks them, fastest first, into
disjoint chains that each cover blocks 1..L, until the chains' total rate reaches lambda / (rho_bar c).

Alg. 1 leaves the servers after its stop without blocks. With `spare_chains=True` (an option of ours, not of the
paper; the spec allows "in a live swarm, can be given a spare chain") the leftover servers keep being stacked by the
same order and shift rule into further complete chains, so a live swarm does not leave volunteer GPUs idle; GCA then
allocates cache over the whole placement. The chains up to the stop, and hence the surrogate K(c), are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.swarm_model import ModelSpec, Placement, ServerSpec, SwarmModel, units_that_fit


def blocks_for_capacity(server: ServerSpec, model: ModelSpec, capacity: int) -> int:
    """Gives m_j(c): the blocks `server` can host while keeping `capacity` cache slots per hosted block."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    return min(units_that_fit(server.memory_gb, model.block_gb + model.cache_gb * capacity), model.blocks)


def service_time_ms(server: ServerSpec, model: ModelSpec, capacity: int) -> float:
    """Gives t_j(c) = tau_c + tau_p m_j(c): the time one job spends on `server` when it runs all its blocks."""
    return server.job_time_ms(blocks_for_capacity(server, model, capacity))


def amortized_time_ms(server: ServerSpec, model: ModelSpec, capacity: int) -> float:
    """Gives t~_j(c) = t_j(c) / m_j(c), the time per block; infinite for a server that can host no block."""
    blocks = blocks_for_capacity(server, model, capacity)
    return server.job_time_ms(blocks) / blocks if blocks > 0 else math.inf


@dataclass(frozen=True)
class DisjointChain:
    """One chain GBP-CR stacked: its servers in block order and the time a job takes on it (all blocks run)."""

    servers: tuple[str, ...]
    service_time_ms: float


@dataclass(frozen=True)
class GreedyPlacement:
    """What GBP-CR built: the placement, the complete disjoint chains, and whether they reach the target rate."""

    placement: Placement
    chains: tuple[DisjointChain, ...]  # the chains Alg. 1 stacks up to its stop
    target_met: bool
    fastest_block_ms: float = math.inf  # min_j t~_j(c) over the servers that can host a block at c
    spare: tuple[DisjointChain, ...] = ()  # complete chains of the servers left over at the stop (spare_chains)

    @property
    def total_rate_per_ms(self) -> float:
        """Gives the sum of the disjoint chains' rates, 1 / T per chain (the nu of Alg. 1, unscaled by c)."""
        return sum(1.0 / chain.service_time_ms for chain in self.chains)


def ranked_servers(swarm: SwarmModel, capacity: int) -> list[tuple[float, int, ServerSpec, int]]:
    """Gives (t~_j(c), index, server, m_j(c)) for the servers that can host a block, by increasing t~ (ties: index)."""
    ranked = []
    for index, server in enumerate(swarm.servers):
        blocks = blocks_for_capacity(server, swarm.model, capacity)
        if blocks > 0:
            ranked.append((amortized_time_ms(server, swarm.model, capacity), index, server, blocks))
    ranked.sort(key=lambda item: (item[0], item[1]))
    return ranked


def greedy_order(swarm: SwarmModel, capacity: int) -> list[ServerSpec]:
    """Gives the servers that can host a block at `capacity`, by increasing amortized time (ties: given order)."""
    return [server for _, _, server, _ in ranked_servers(swarm, capacity)]


def gbp_cr_plan(
    swarm: SwarmModel, capacity: int, arrival_rate_per_ms: float, rho_bar: float, *, spare_chains: bool = False
) -> GreedyPlacement:
    """Gives GBP-CR's placement and its disjoint chains for required capacity `capacity` (Alg. 1).

    Stops as soon as the complete chains' rate reaches arrival_rate / (rho_bar capacity); servers left over host
    nothing, unless `spare_chains`: then they are stacked by the same rule into further chains (`spare`). Servers
    of an unfinished last chain keep their blocks either way (GCA may still combine them with others).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if arrival_rate_per_ms < 0 or not 0 < rho_bar <= 1:
        raise ValueError("arrival rate must be >= 0 and rho_bar in (0, 1]")
    model = swarm.model
    target_rate = arrival_rate_per_ms / (rho_bar * capacity)
    blocks: dict[str, tuple[int, int]] = {server.name: (0, 0) for server in swarm.servers}
    chains: list[DisjointChain] = []
    spare: list[DisjointChain] = []
    next_block, chain_time_ms, chain_servers = 1, 0.0, []
    total_rate = 0.0
    target_met = False
    ranked = ranked_servers(swarm, capacity)
    for _, _, server, count in ranked:
        # the last server of a chain shifts back so that it ends at block L (it overlaps its predecessor)
        first = min(next_block, model.blocks - count + 1)
        blocks[server.name] = (first, count)
        chain_time_ms += service_time_ms(server, model, capacity)  # t_j(c): the server runs all its m_j(c) blocks
        chain_servers.append(server.name)
        next_block = min(next_block + count - 1, model.blocks) + 1
        if next_block > model.blocks:
            chain = DisjointChain(tuple(chain_servers), chain_time_ms)
            if target_met:
                spare.append(chain)
            else:
                chains.append(chain)
                total_rate += 1.0 / chain_time_ms
                if total_rate >= target_rate:
                    target_met = True
                    if not spare_chains:
                        break
            next_block, chain_time_ms, chain_servers = 1, 0.0, []
    fastest = ranked[0][0] if ranked else math.inf
    return GreedyPlacement(Placement(blocks), tuple(chains), target_met, fastest, tuple(spare))


def gbp_cr(
    swarm: SwarmModel, capacity: int, arrival_rate_per_ms: float, rho_bar: float, *, spare_chains: bool = False
) -> Placement:
    """Gives GBP-CR's block placement for required capacity `capacity` (every server listed; unused: (0, 0))."""
    return gbp_cr_plan(swarm, capacity, arrival_rate_per_ms, rho_bar, spare_chains=spare_chains).placement
