"""Plain records of the chain-composition model: servers, the model's blocks, placements and chains.

Notation follows `shared/specs/chain-composition.md`: server j has memory M_j (GB), communication time tau_c[j]
and per-block computation time tau_p[j] (ms, per job); the model has L blocks, s_m GB of parameters per block and
s_c GB of KV cache per block per job. Blocks are 1-based here, as in the paper. Times are in ms throughout, so
rates are in jobs per ms; callers convert a per-second arrival rate with `per_ms`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property

# rounding slack before a floor, so exact quotients (26 / 13, 0.33 / 0.11) do not come out one short
FLOOR_SLACK = 1e-9


def per_ms(rate_per_s: float) -> float:
    """Gives a rate per second as a rate per millisecond."""
    return rate_per_s / 1000.0


def units_that_fit(amount_gb: float, unit_gb: float) -> int:
    """Gives floor(amount_gb / unit_gb): how many units fit, with FLOOR_SLACK against rounding."""
    return math.floor(amount_gb / unit_gb + FLOOR_SLACK)


@dataclass(frozen=True)
class ServerSpec:
    """One server: its name, memory and the time it takes per job (whole job, not per token).

    `tau_p_batch_ms` is how much tau_p grows for each other job the server runs at the same time (its decode steps
    share batches: a batch of n costs a + b * n per block, so a job's tau_p at n jobs is tau_p + (n - 1) * output
    tokens * b). The paper's model has none (a chain runs c jobs at the speed of one): 0, the default, is that model.
    `tau_p_prefill_ms` is the prompt's share of tau_p: the engine's token budget lets one prompt chunk into each
    batch, so jobs that prefill on a server at once share its prefill (the simulator's `SharedService`); 0, the
    default, is the paper's model, where a job's time is one piece. Policies rank by tau_p alone.
    """

    name: str
    memory_gb: float
    tau_c_ms: float  # communication time of one job to this server
    tau_p_ms: float  # computation time of one job through one block, alone on the server
    tau_p_batch_ms: float = 0.0  # growth of tau_p per other job running on the server at once
    tau_p_prefill_ms: float = 0.0  # the part of tau_p that is the prompt's prefill (one chunk per batch)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a server needs a non-empty name")
        if not (self.memory_gb >= 0 and self.tau_c_ms >= 0 and self.tau_p_ms > 0 and self.tau_p_batch_ms >= 0
                and 0 <= self.tau_p_prefill_ms <= self.tau_p_ms):
            raise ValueError(f"server {self.name!r}: memory_gb >= 0, tau_c_ms >= 0, tau_p_ms > 0, "
                             "tau_p_batch_ms >= 0 and 0 <= tau_p_prefill_ms <= tau_p_ms are required")

    def job_time_ms(self, blocks: int, others: int = 0) -> float:
        """Gives tau_c + (tau_p + others * tau_p_batch) * blocks: the time one job spends here when it runs `blocks`
        of the model's blocks beside `others` jobs."""
        return self.tau_c_ms + (self.tau_p_ms + others * self.tau_p_batch_ms) * blocks


@dataclass(frozen=True)
class ModelSpec:
    """The served model: L blocks, each with `block_gb` of parameters and `cache_gb` of KV per job."""

    blocks: int
    block_gb: float
    cache_gb: float

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.block_gb <= 0 or self.cache_gb <= 0:
            raise ValueError("a model needs blocks >= 1, block_gb > 0 and cache_gb > 0")


@dataclass(frozen=True)
class SwarmModel:
    """A model and the servers that may host it; server names are unique and keep their given order."""

    model: ModelSpec
    servers: tuple[ServerSpec, ...]

    def __post_init__(self) -> None:
        names = [server.name for server in self.servers]
        if len(set(names)) != len(names):
            raise ValueError("server names must be unique")

    @cached_property
    def _by_name(self) -> dict[str, ServerSpec]:
        # frozen, so the index never goes stale; cached_property writes the instance dict, not a field
        return {server.name: server for server in self.servers}

    def server(self, name: str) -> ServerSpec:
        """Gives the server called `name` (KeyError if there is none)."""
        return self._by_name[name]

    def with_batch_slopes(self, slopes_ms: Mapping[str, float]) -> SwarmModel:
        """Gives this swarm with each server's tau_p_batch set from `slopes_ms` (0 for servers it leaves out)."""
        return SwarmModel(self.model, tuple(replace(server, tau_p_batch_ms=slopes_ms.get(server.name, 0.0))
                                            for server in self.servers))

    def paper_model(self) -> SwarmModel:
        """Gives this swarm as the paper models it: no batch slopes and no prefill shares (fixed service times)."""
        return SwarmModel(self.model, tuple(replace(server, tau_p_batch_ms=0.0, tau_p_prefill_ms=0.0)
                                            for server in self.servers))


@dataclass(frozen=True)
class Placement:
    """Which blocks each server hosts: server name -> (first block a_j, 1-based; number of blocks m_j).

    A server with m_j = 0 hosts nothing; servers missing from the map host nothing either.
    """

    blocks: dict[str, tuple[int, int]]

    def first_block(self, name: str) -> int:
        return self.blocks.get(name, (0, 0))[0]

    def num_blocks(self, name: str) -> int:
        return self.blocks.get(name, (0, 0))[1]

    def hosting(self) -> list[str]:
        """Gives the names of servers that host at least one block, in sorted order."""
        return sorted(name for name, (_, count) in self.blocks.items() if count > 0)

    def residual_slots(self, swarm: SwarmModel, name: str) -> int:
        """Gives Mtilde_j: the cache slots (one block, one job each) left on `name` after its parameters."""
        server, model = swarm.server(name), swarm.model
        free_gb = server.memory_gb - model.block_gb * self.num_blocks(name)
        if free_gb < 0:
            raise ValueError(f"server {name!r} cannot hold its {self.num_blocks(name)} placed blocks")
        return units_that_fit(free_gb, model.cache_gb)


@dataclass(frozen=True)
class Chain:
    """A server chain that covers blocks 1..L in order, with its capacity (concurrent jobs) and service time.

    `blocks_per_server[i]` is m_ij for the i-th server: the blocks it processes for a job on this chain, which
    is also how many cache slots one job holds on it.
    """

    servers: tuple[str, ...]
    blocks_per_server: tuple[int, ...]
    capacity: int
    service_time_ms: float

    @property
    def rate_per_ms(self) -> float:
        """Gives mu_k = 1 / T_k, in jobs per ms."""
        return 1.0 / self.service_time_ms
