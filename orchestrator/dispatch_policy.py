"""The interface the simulator and the live orchestrator drive: a dispatch policy over a placement.

Two kinds of policy sit behind it. Chain policies (JFFC, JSQ, ..., round-robin) own a fixed list of chains with
capacities and start a job on one of them. Path policies (PETALS, BPRR, Helix-style) route each request over
servers and start it once every server on its path has the cache slots it needs. Either way the policy answers an
event with the jobs that start now and the route each one takes; the simulator times the jobs and checks that no
server ever holds more cache slots than it has.

Policies are pure: no I/O, no clocks (time comes in as `now_ms`), randomness only from a Generator they are given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from orchestrator.swarm_model import Chain, Placement, SwarmModel


class NoFeasiblePlan(ValueError):
    """The policy cannot serve the model on this swarm (e.g. no server fits the whole model, or blocks are missing)."""


@dataclass(frozen=True)
class Route:
    """Where a job runs: servers in block order, the cache slots it holds on each, its mean service time.

    A job of size s on this route takes s * `service_time_ms`. `chain` is the index into the policy's fixed
    chains, or None for a path routed per request.
    """

    servers: tuple[str, ...]
    blocks_per_server: tuple[int, ...]
    service_time_ms: float
    chain: int | None = None

    @classmethod
    def of_chain(cls, chain: Chain, index: int) -> Route:
        """Gives the route of fixed chain number `index`."""
        return cls(chain.servers, chain.blocks_per_server, chain.service_time_ms, index)


@dataclass(frozen=True)
class Start:
    """Job `job` starts now on `route`."""

    job: int
    route: Route


class DispatchPolicy(Protocol):
    """A policy the simulator drives: one instance per run, fed every arrival and every completion in time order."""

    name: str
    placement: Placement
    chains: Sequence[Chain]  # fixed chains (empty for per-request routing)

    def arrive(self, job: int, now_ms: float) -> list[Start]:
        """Gives the jobs that start because `job` arrived (often just `job`, or none if it waits)."""
        ...

    def complete(self, job: int, now_ms: float) -> list[Start]:
        """Gives the jobs that start because `job` finished and freed its slots."""
        ...


@runtime_checkable
class Waking(Protocol):
    """A policy that also acts at times of its own (a client retrying after a backoff): the simulator calls `wake`
    at `next_wake_ms()` unless an arrival or a completion comes first."""

    def next_wake_ms(self) -> float | None:
        """Gives when the policy wants to act next, None for never (until the next arrival or completion)."""
        ...

    def wake(self, now_ms: float) -> list[Start]:
        """Gives the jobs that start at `now_ms`, the time `next_wake_ms` gave."""
        ...


def hop_blocks(placement: Placement, servers: Sequence[str], blocks: int) -> tuple[int, ...]:
    """Gives m_ij for each hop of a server path: the blocks each server processes after its predecessor."""
    counts, last = [], 0  # last block processed so far (dummy server j0 hosts block 0)
    for name in servers:
        end = placement.first_block(name) + placement.num_blocks(name) - 1
        start = placement.first_block(name)
        if not (start <= last + 1 <= end):
            raise ValueError(f"server {name!r} (blocks {start}..{end}) cannot follow block {last}")
        counts.append(end - last)
        last = end
    if last != blocks:
        raise ValueError(f"path ends at block {last}, not {blocks}")
    return tuple(counts)


def path_service_time_ms(swarm: SwarmModel, servers: Sequence[str], blocks_per_server: Sequence[int]) -> float:
    """Gives T = sum over hops of tau_c[j] + tau_p[j] * m_ij (spec: chain service time)."""
    total = 0.0
    for name, count in zip(servers, blocks_per_server, strict=True):
        server = swarm.server(name)
        total += server.tau_c_ms + server.tau_p_ms * count
    return total


def batch_slopes(swarm: SwarmModel) -> dict[str, float]:
    """Gives each server's tau_p growth per other job it runs at once (ms per block), for servers that have one."""
    return {server.name: server.tau_p_batch_ms for server in swarm.servers if server.tau_p_batch_ms > 0}


def loaded_service_time_ms(
    base_ms: float, servers: Sequence[str], blocks_per_server: Sequence[int], slopes: Mapping[str, float],
    others: Mapping[str, int],
) -> float:
    """Gives a route's service time when its servers run `others` other jobs each: its time alone (`base_ms`) plus,
    per hop, m_ij * tau_p_batch[j] * others[j]."""
    extra = sum(count * slopes.get(name, 0.0) * others.get(name, 0)
                for name, count in zip(servers, blocks_per_server, strict=True))
    return base_ms + extra


# Jobs may hold fractions of a cache slot (their own KV as a share of s_c): sums of them taken in another order may
# miss or exceed a whole slot in the last bits, so slot checks allow this much.
SLOT_SLACK = 1e-9


def server_slots(swarm: SwarmModel, placement: Placement) -> dict[str, int]:
    """Gives Mtilde_j (cache slots left after parameters) for every server that hosts blocks, by name."""
    return {name: placement.residual_slots(swarm, name) for name in placement.hosting()}
