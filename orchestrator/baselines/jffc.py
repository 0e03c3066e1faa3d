"""The "JFFC only" baseline: the whole model on every server that fits it, dispatched by the shipped JFFC."""

from __future__ import annotations

import math

from orchestrator.dispatch import JFFCPolicy
from orchestrator.dispatch_policy import NoFeasiblePlan
from orchestrator.swarm_model import Chain, Placement, SwarmModel


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


def jffc_only(swarm: SwarmModel, *, ranking: SwarmModel | None = None) -> JFFCPolicy:
    """Gives the "JFFC only" baseline: whole-model servers as chains, dispatched by JFFC (ranking by loaded service
    times with the batch slopes of `ranking`, default `swarm`)."""
    placement, chains = whole_model_chains(swarm)
    return JFFCPolicy(chains, placement, name="jffc-only", swarm=ranking or swarm)
