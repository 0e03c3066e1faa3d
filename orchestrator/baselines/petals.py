"""PETALS baseline: Petals' block selection as servers join, and min-latency routing that waits for cache.

Placement (Petals `choose_num_blocks` / `block_selection`), with servers joining in a random order:
- m_j = min(floor(M_j / (s_m + s_c * cache_jobs)), L): a Petals server reserves attention cache for a fixed number
  of tokens per block (`attn_cache_tokens`, 4096 for BLOOM = 2 sessions of 2048 tokens), not for the load;
- its start block is the window whose sorted per-block throughputs are lexicographically smallest (ties: the
  lowest start), where a block's throughput is the sum over the servers hosting it;
- a server's throughput is Petals' min(network rps, compute rps / average blocks used), here
  min(1 / tau_c[j], 2 / (tau_p[j] * (1 + m_j))) jobs per ms.
Its cache then is all memory left after the parameters (Mtilde_j), as in every policy here.

Routing: per request, the path of least estimated latency, link cost tau_c[j] + tau_p[j] * m_ij plus a penalty
(Petals' 10 s allocation delay) where j has fewer free slots than the request needs now. The request then waits
on that path until its servers have room (`PathPolicy`). Petals' periodic rebalancing of servers is not modelled.
"""

from __future__ import annotations

import math

import numpy as np

from orchestrator.baselines.path_routing import PathPolicy
from orchestrator.sim.policy import NoFeasiblePlan, Route
from orchestrator.swarm_model import Placement, SwarmModel

PETALS_CACHE_JOBS = 2  # attn_cache_tokens 4096 / max sequence 2048 (BLOOM has no grouped-query attention)
PETALS_ALLOC_PENALTY_MS = 10_000.0


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
        count = min(math.floor(server.memory_gb / (model.block_gb + model.cache_gb * cache_jobs) + 1e-9), model.blocks)
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


class PetalsRouting(PathPolicy):
    """Min-latency routing with Petals' penalty for servers whose cache is full; the request waits for cache."""

    name = "petals"

    def __init__(self, swarm: SwarmModel, placement: Placement, penalty_ms: float = PETALS_ALLOC_PENALTY_MS) -> None:
        self.penalty_ms = penalty_ms
        super().__init__(swarm, placement)

    def choose(self, job: int, now_ms: float) -> Route:
        def cost(name: str, count: int) -> float:
            base = self.base_cost(name, count)
            return base + (self.penalty_ms if self.slots_free[name] < count else 0.0)

        found = self.graph.shortest_path(cost)
        assert found is not None  # the constructor checked that a path exists
        return self.graph.route(found[0])


def petals(swarm: SwarmModel, rng: np.random.Generator) -> PetalsRouting:
    """Gives the PETALS baseline: random join order placement and min-latency routing."""
    return PetalsRouting(swarm, petals_placement(swarm, rng))
