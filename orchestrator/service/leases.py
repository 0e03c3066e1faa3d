"""Live dispatch: JFFC over the current plan's chains, leases that clients renew, and the one central FIFO queue.

A session's request (`acquire`) becomes a job of the shipped `orchestrator.dispatch.JFFC`: it starts at once on the
fastest chain with a free slot, or waits in the queue until a slot frees (`release`, or a lease that expired because
its client stopped renewing it). While the orchestrator moves blocks between plans, the dispatcher is paused:
requests queue, in order, and start on the new plan's chains once it is installed. Leases on a chain the new plan
keeps (the same servers over the same blocks) keep their slot; the others run to their end uncounted.

Runs on the orchestrator's event loop; times come in as arguments.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from orchestrator.dispatch import JFFC
from orchestrator.swarm_model import Chain
from swarm.errors import SwarmError


class LeaseNotFound(SwarmError):
    """The lease is unknown: it was released, or it expired because its client stopped renewing it."""


@dataclass(frozen=True)
class Span:
    """Blocks [start, end) of a chain, served by one server."""

    peer_id: str
    start: int
    end: int

    def to_wire(self) -> dict[str, object]:
        return {"peer_id": self.peer_id, "start": self.start, "end": self.end}


@dataclass(frozen=True)
class LiveChain:
    """A chain of the current plan: its spans in block order, capacity and mean service time."""

    spans: tuple[Span, ...]
    capacity: int
    service_time_ms: float

    @staticmethod
    def of(chain: Chain) -> LiveChain:
        """Gives the live form of a policy chain (its servers are peer ids; m_ij blocks each, in order)."""
        spans, start = [], 0
        for peer_id, blocks in zip(chain.servers, chain.blocks_per_server, strict=True):
            spans.append(Span(peer_id, start, start + blocks))
            start += blocks
        return LiveChain(tuple(spans), chain.capacity, chain.service_time_ms)


def _swapped(spans: tuple[Span, ...], source: str, destination: str) -> tuple[Span, ...]:
    return tuple(Span(destination if span.peer_id == source else span.peer_id, span.start, span.end) for span in spans)


@dataclass
class Lease:
    """A slot of a chain held by one session until it is released or stops being renewed."""

    lease_id: str
    chain: LiveChain
    renewed_s: float
    chain_index: int | None  # in the current plan; None once a new plan no longer has its chain
    prompt_tokens: int = 0


@dataclass
class _Waiter:
    job_id: str
    started: asyncio.Future[Lease]
    prompt_tokens: int
    queued_s: float


@dataclass
class LeaseTable:
    """The live JFFC dispatcher with its leases; `dispatched` counts the sessions that got a chain."""

    lease_ttl_s: float
    chains: list[LiveChain] = field(default_factory=list)
    dispatched: int = 0
    _jffc: JFFC | None = None
    _leases: dict[str, Lease] = field(default_factory=dict)
    _waiting: dict[str, _Waiter] = field(default_factory=dict)
    _paused: deque[str] = field(default_factory=deque)  # requests that arrived while paused, in order
    _index: dict[tuple[Span, ...], int] = field(default_factory=dict)  # the plan's chains by their spans
    _standby_peers: set[str] = field(default_factory=set)  # servers the KV packing keeps as standbys

    @property
    def paused(self) -> bool:
        return self._jffc is None

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def in_use(self, chain_index: int) -> int:
        """Gives the sessions chain `chain_index` runs now."""
        return self._jffc.busy(chain_index) if self._jffc is not None else 0

    def service_time_ms(self, chain_index: int) -> float:
        """Gives the service time a session starting on chain `chain_index` now would see (JFFC's ranking)."""
        if self._jffc is None:
            return self.chains[chain_index].service_time_ms
        return self._jffc.service_time_ms(chain_index)

    def set_standby(self, peers: Iterable[str]) -> None:
        """Makes the chains through any of `peers` (servers the KV packing keeps as standbys) the last resort of
        JFFC: new sessions go to them only when no other chain has a free slot."""
        standby = set(peers)
        self._standby_peers = standby
        if self._jffc is not None:
            self._jffc.set_standby(index for index, chain in enumerate(self.chains)
                                   if any(span.peer_id in standby for span in chain.spans))

    def pause(self) -> None:
        """Stops starting jobs (blocks are about to move); queued and new requests wait for `install`."""
        if self._jffc is not None:
            self._paused.extend(job for job in self._jffc.queued() if job in self._waiting)
            self._jffc = None

    def install(self, chains: list[LiveChain], now_s: float, batch_slopes: Mapping[str, float] | None = None) -> None:
        """Dispatches over `chains` from now on (ranked by their service time at their servers' present batches,
        with `batch_slopes`: see `orchestrator.dispatch`): carries over the leases of chains it keeps, then starts
        or queues the waiting requests in their order."""
        self.pause()
        self.chains = list(chains)
        self._jffc = JFFC([Chain(tuple(s.peer_id for s in c.spans), tuple(s.end - s.start for s in c.spans),
                                 c.capacity, c.service_time_ms) for c in chains], batch_slopes)
        self._index = {chain.spans: index for index, chain in enumerate(chains)}
        self.set_standby(self._standby_peers)
        for lease in self._leases.values():
            lease.chain_index = self._index.get(lease.chain.spans)
            if lease.chain_index is not None:
                self._jffc.occupy(lease.chain_index)
        waiting, self._paused = list(self._paused), deque()
        for job_id in waiting:
            self._arrive(job_id, now_s)

    def request(self, prompt_tokens: int, now_s: float) -> tuple[str, asyncio.Future[Lease]]:
        """Gives a job id and the future lease of a new request: resolved now if a chain has a free slot."""
        job_id = uuid.uuid4().hex
        waiter = _Waiter(job_id, asyncio.get_running_loop().create_future(), prompt_tokens, now_s)
        self._waiting[job_id] = waiter
        if self._jffc is None:
            self._paused.append(job_id)
        else:
            self._arrive(job_id, now_s)
        return job_id, waiter.started

    def _arrive(self, job_id: str, now_s: float) -> None:
        assert self._jffc is not None
        index = self._jffc.arrive(job_id)
        if index is not None:
            self._start(job_id, index, now_s)

    def _start(self, job_id: str, index: int, now_s: float) -> None:
        waiter = self._waiting.pop(job_id)
        lease = Lease(uuid.uuid4().hex, self.chains[index], now_s, index, waiter.prompt_tokens)
        self._leases[lease.lease_id] = lease
        self.dispatched += 1
        waiter.started.set_result(lease)

    def withdraw(self, job_id: str) -> None:
        """Forgets a request whose client went away before it started."""
        if self._waiting.pop(job_id, None) is None:
            return
        if self._jffc is not None:
            self._jffc.withdraw(job_id)
        if job_id in self._paused:
            self._paused.remove(job_id)

    def renew(self, lease_id: str, now_s: float) -> Lease:
        """Gives the lease, renewed at `now_s`; raises LeaseNotFound if it is gone."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(f"lease {lease_id!r} is not held (released, or expired after {self.lease_ttl_s} s)")
        lease.renewed_s = now_s
        return lease

    def release(self, lease_id: str, now_s: float) -> Lease:
        """Ends a lease: its slot goes to the head of the queue, if any. Raises LeaseNotFound if it is gone."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseNotFound(f"lease {lease_id!r} is not held (released, or expired after {self.lease_ttl_s} s)")
        if lease.chain_index is not None and self._jffc is not None:
            following = self._jffc.complete(lease.chain_index)
            if following is not None:
                self._start(str(following), lease.chain_index, now_s)
        return lease

    def holds(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def can_follow(self, lease_id: str, source: str, destination: str) -> bool:
        """Gives whether the session of `lease_id` may move its span from server `source` to `destination`: the
        chain that makes is one of the plan's, with a free slot (a lease the plan no longer counts may go anywhere)."""
        lease = self._leases.get(lease_id)
        if lease is None or self._jffc is None:
            return False
        if lease.chain_index is None:
            return True
        target = self._index.get(_swapped(lease.chain.spans, source, destination))
        if target is None:
            return False
        return target == lease.chain_index or self._jffc.busy(target) < self._jffc.capacity(target)

    def follow(self, lease_id: str, source: str, destination: str, now_s: float) -> None:
        """Moves the lease of a session whose span moved from `source` to `destination` to the chain it now runs
        on: its old chain's slot frees (the queue's head may take it), the new chain's is taken."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return
        spans = _swapped(lease.chain.spans, source, destination)
        target = self._index.get(spans) if lease.chain_index is not None and self._jffc is not None else None
        if target is not None:
            assert self._jffc is not None
            self._jffc.occupy(target)
        if lease.chain_index is not None and self._jffc is not None:
            following = self._jffc.complete(lease.chain_index)
            if following is not None:
                self._start(str(following), lease.chain_index, now_s)
        lease.chain_index = target  # None: on no chain of the plan now, it runs to its end uncounted
        lease.chain = self.chains[target] if target is not None else dataclasses.replace(lease.chain, spans=spans)

    def expire(self, now_s: float) -> list[Lease]:
        """Releases every lease not renewed within `lease_ttl_s`; gives them."""
        stale = [lease_id for lease_id, lease in self._leases.items() if now_s - lease.renewed_s > self.lease_ttl_s]
        return [self.release(lease_id, now_s) for lease_id in stale]

    @property
    def leases(self) -> int:
        return len(self._leases)
