"""JFFC behind the simulator's policy interface, and the "JFFC only" baseline (the whole model on every server).

`JFFCPolicy` wraps the shipped dispatcher (`orchestrator.dispatch.JFFC`, Alg. 3) without changing its decisions:
the proposed method and "JFFC only" both run through it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from orchestrator.dispatch import JFFC
from orchestrator.sim.policy import NoFeasiblePlan, Route, Start
from orchestrator.swarm_model import Chain, Placement, SwarmModel


class JFFCPolicy:
    """Join-the-Fastest-Free-Chain over fixed chains with one central FIFO queue."""

    def __init__(self, chains: Sequence[Chain], placement: Placement, name: str = "jffc") -> None:
        if not chains:
            raise ValueError("JFFC needs at least one chain")
        self.name = name
        self.placement = placement
        self.chains = tuple(chains)
        self._routes = [Route.of_chain(chain, index) for index, chain in enumerate(self.chains)]
        self._dispatcher = JFFC(list(self.chains))
        self._chain_of: dict[int, int] = {}

    def arrive(self, job: int, now_ms: float) -> list[Start]:
        index = self._dispatcher.arrive(job)
        return [] if index is None else [self._start(job, index)]

    def complete(self, job: int, now_ms: float) -> list[Start]:
        index = self._chain_of.pop(job)
        following = self._dispatcher.complete(index)
        return [] if following is None else [self._start(following, index)]

    def _start(self, job: int, index: int) -> Start:
        self._chain_of[job] = index
        return Start(job, self._routes[index])


def whole_model_chains(swarm: SwarmModel) -> tuple[Placement, list[Chain]]:
    """Gives the placement with all L blocks on every server that fits them, and one chain per such server.

    Capacity floor((M_j - s_m L) / (s_c L)): each job holds L cache slots on its single server.
    """
    model = swarm.model
    blocks: dict[str, tuple[int, int]] = {}
    chains: list[Chain] = []
    for server in swarm.servers:
        free_gb = server.memory_gb - model.block_gb * model.blocks
        capacity = math.floor(free_gb / (model.cache_gb * model.blocks) + 1e-9)
        if capacity < 1:
            blocks[server.name] = (0, 0)
            continue
        blocks[server.name] = (1, model.blocks)
        service = server.tau_c_ms + server.tau_p_ms * model.blocks
        chains.append(Chain((server.name,), (model.blocks,), capacity, service))
    if not chains:
        raise NoFeasiblePlan(
            f"JFFC only: no server fits the whole model ({model.blocks} blocks = "
            f"{model.blocks * model.block_gb:.1f} GB) plus one job's cache"
        )
    chains.sort(key=lambda chain: (chain.service_time_ms, chain.servers))
    return Placement(blocks), chains


def jffc_only(swarm: SwarmModel) -> JFFCPolicy:
    """Gives the "JFFC only" baseline: whole-model servers as chains, dispatched by JFFC."""
    placement, chains = whole_model_chains(swarm)
    return JFFCPolicy(chains, placement, name="jffc-only")
