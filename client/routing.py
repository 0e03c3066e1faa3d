"""Petals-style min-latency routing over DHT records: the cheapest chain of server spans covering [start, end).

Pure: records and measured RTTs in, spans out. Cost of using server s for blocks [i, j) is its RTT plus
(j - i) x its measured per-block compute time; a server whose headroom rule admits no new session is penalized,
not excluded, so that a chain still exists (the server answers busy and the client moves on).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from swarm.errors import NoRouteFound
from swarm.records import ServerRecord, ServerState

NO_FREE_PAGES_PENALTY_MS = 10_000.0
DEFAULT_RTT_MS = 100.0  # for servers not measured yet


@dataclass(frozen=True)
class Span:
    """Blocks [start, end) served by one server of a chain."""

    peer_id: str
    start: int
    end: int
    record: ServerRecord

    @property
    def length(self) -> int:
        return self.end - self.start


def servers_of(records_by_block: Iterable[Mapping[str, ServerRecord]]) -> dict[str, ServerRecord]:
    """Gives each online server's record once (peer_id -> record)."""
    servers: dict[str, ServerRecord] = {}
    for records in records_by_block:
        for peer_id, record in records.items():
            if record.state == ServerState.online:
                servers[peer_id] = record
    return servers


def kv_fits(record: ServerRecord, blocks: int, batch: int = 1) -> bool:
    """Gives whether `record`'s server would admit a session of `batch` rows on `blocks` of its blocks now.

    Servers announce how many one-row sessions over all their blocks their headroom rule admits (`sessions_fit`);
    a session on fewer blocks, or of more rows, takes proportionally fewer or more of that room."""
    hosted = record.block_end - record.block_start
    return record.sessions_fit * hosted >= blocks * batch


def span_cost_ms(record: ServerRecord, blocks: int, *, rtt_ms: float, max_length: int, batch: int = 1) -> float:
    """Gives the estimated per-token latency of serving `blocks` blocks on this server."""
    cost = rtt_ms + blocks * record.block_compute_ms
    if not kv_fits(record, blocks, batch) or max_length > record.max_length or not record.accepting:
        cost += NO_FREE_PAGES_PENALTY_MS  # a standby, like a full server, only when nothing else covers the blocks
    return cost


def find_route(
    servers: Mapping[str, ServerRecord],
    start: int,
    end: int,
    *,
    rtt_ms: Mapping[str, float],
    max_length: int,
    batch: int = 1,
    banned: Iterable[str] = (),
) -> list[Span]:
    """Gives the min-latency chain of spans covering blocks [start, end) (Dijkstra over block boundaries)."""
    banned = set(banned)
    candidates = [servers[peer_id] for peer_id in sorted(servers) if peer_id not in banned]
    best: dict[int, float] = {start: 0.0}
    previous: dict[int, tuple[int, Span]] = {}
    queue: list[tuple[float, int]] = [(0.0, start)]
    while queue:
        cost, block = heapq.heappop(queue)
        if block == end:
            break
        if cost > best.get(block, float("inf")):
            continue
        for record in candidates:
            if not record.block_start <= block < record.block_end:
                continue
            for stop in range(block + 1, min(record.block_end, end) + 1):
                rtt = rtt_ms.get(record.peer_id, DEFAULT_RTT_MS)
                total = cost + span_cost_ms(record, stop - block, rtt_ms=rtt, max_length=max_length, batch=batch)
                if total < best.get(stop, float("inf")):
                    best[stop] = total
                    previous[stop] = (block, Span(record.peer_id, block, stop, record))
                    heapq.heappush(queue, (total, stop))
    if end not in previous and start != end:
        raise NoRouteFound(f"no chain of online servers covers blocks {start}:{end} (excluding {len(banned)} banned)")
    route: list[Span] = []
    block = end
    while block != start:
        block, span = previous[block]
        route.append(span)
    return route[::-1]
