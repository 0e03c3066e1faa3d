"""A server's part in KunServe's dropping: without an orchestrator, the servers of a segment run
`orchestrator.buddy.segment_loop.DropLoop` (it acts only while this server leads the segment), and each takes
`drop` and `restore` from its segment's leader, checking the claim against its own view of the DHT. The same view
tells which servers may lend this one a victim's KV (`may_lend`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from hivemind import DHT
from hivemind.p2p import P2P

from orchestrator.buddy.segment_loop import DropLoop, drop_group, restored_of, segment_of
from orchestrator.packing.segment_loop import leader_of
from server.config import ServerConfig
from server.hosting import Hosting
from swarm.dht import lookup_servers_async
from swarm.errors import PeerUnreachable
from swarm.model import ModelSource
from swarm.records import ServerRecord
from swarm.rpc import RpcConnection, dial

GROUP_MAX_AGE_S = 2.0  # how long a view of the segment's servers in the DHT is reused
REFUSED_ON_WIRE = 512  # refused sessions a server names in `info`, the latest


def refused_digests(refused: Mapping[str, int]) -> dict[str, int]:
    """Gives the latest of the sessions a server refused for room (id -> pages) keyed by a digest of their id, as
    `info` shows them: the segment's leader counts a session that several members refused once, and no one learns
    a session's id from it."""
    latest = list(refused.items())[-REFUSED_ON_WIRE:]
    return {_digest(session_id): pages for session_id, pages in latest}


def opened_digests(opened: Sequence[str]) -> list[str]:
    """Gives the latest of the sessions that opened on a server (their wait keys, `SessionTable.opened`) as
    digests, as `info` shows them beside `refused_digests`."""
    return [_digest(key) for key in opened[-REFUSED_ON_WIRE:]]


def _digest(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def refused_twice(members: list[Mapping[str, Any]], opened: Iterable[Any] = ()) -> int:
    """Gives the pages the members' `kv_demand_pages` count beyond the sessions still waiting: a client that every
    server refused asked each of them (counted once), and a session that one member refused and another opened
    since waits no more (counted not at all) (`members`: each one's `refused_digests`; `opened`: the members'
    `opened_digests`)."""
    total, once = 0, {}
    for refused in members:
        for digest, pages in refused.items():
            if isinstance(pages, int) and pages >= 0:
                total += pages
                once[digest] = max(once.get(digest, 0), pages)
    done = {digest for digest in opened if isinstance(digest, str)}
    return total - sum(pages for digest, pages in once.items() if digest not in done)


def announces(record: ServerRecord, start: int, end: int) -> bool:
    """Gives whether blocks [start, end) lie in `record`'s segment: the range it can restore, else the one it serves."""
    first, last = segment_of(record)
    return first <= start < end <= last


class DropHost(Protocol):
    """What a drop member needs of its server (`server.server.SwarmServer`)."""

    config: ServerConfig
    source: ModelSource
    hosting: Hosting
    dht: DHT | None
    p2p: P2P | None

    @property
    def peer_id(self) -> str: ...

    def record(self) -> ServerRecord: ...

    async def drop_blocks(self, start: int, end: int, *, reserve_pages: int = 0) -> list[str]: ...

    async def restore_blocks(self, *, evict_merged: bool = False) -> list[str]: ...


class DropMember:
    """The dropping loop and the leader check of one server."""

    def __init__(self, server: DropHost) -> None:
        self.server = server
        self.loop: DropLoop | None = None
        self._view: tuple[float, dict[str, ServerRecord]] = (0.0, {})  # (when, the DHT's records)
        self._connections: dict[str, RpcConnection] = {}
        self._refused_twice = 0  # pages the last look at the segment counted more than once

    def start(self) -> asyncio.Task[None] | None:
        """Starts the segment's drop loop, for a server started with `--kv-dropping` and no orchestrator."""
        config = self.server.config
        if not config.kv_dropping or config.orchestrators:
            return None
        self.loop = DropLoop(self.server.peer_id, group=self._fresh_group, drop=self._ask_to_drop,
                             restore=self._ask_to_restore, period_s=config.drop_period_s,
                             restore_after_s=config.restore_after_s, restore_calm_s=config.restore_calm_s,
                             extra_demand=lambda _: -self._refused_twice)
        return asyncio.create_task(self.loop.run(), name="segment-dropping")

    async def close(self) -> None:
        for connection in self._connections.values():
            await connection.close()

    async def leads_me(self, peer_id: str) -> bool:
        """Gives whether `peer_id` leads this server's segment (by this server's own view of the DHT)."""
        if not self.server.config.kv_dropping or peer_id == self.server.peer_id:
            return False
        group = await self._group(max_age_s=GROUP_MAX_AGE_S)
        if peer_id not in {record.peer_id for record in group}:
            group = await self._group(max_age_s=0.0)
        return leader_of(group) == peer_id

    async def may_lend(self, peer_id: str, start: int, end: int) -> bool:
        """Gives whether `peer_id` announces blocks [start, end) as its own, served or dropped and restorable (by
        this server's view of the DHT, looked up again if the view does not show it): only such a server's victims
        may open here with their KV still on it (`attend_open`), which takes no page at once."""
        for max_age_s in (GROUP_MAX_AGE_S, 0.0):
            record = (await self._records(max_age_s=max_age_s)).get(peer_id)
            if record is not None and announces(record, start, end):
                return True
        return False

    async def _records(self, *, max_age_s: float) -> dict[str, ServerRecord]:
        """Gives the model's servers' records in the DHT, as looked up at most `max_age_s` ago."""
        server = self.server
        when, records = self._view
        if time.monotonic() - when > max_age_s:
            assert server.dht is not None
            records = await lookup_servers_async(server.dht, server.source.model_id,
                                                 timeout_s=server.config.push_timeout_s)
            self._view = (time.monotonic(), records)
        return records

    async def _group(self, *, max_age_s: float) -> list[ServerRecord]:
        own = self.server.record()
        return drop_group({**await self._records(max_age_s=max_age_s), own.peer_id: own}, segment_of(own))

    async def _fresh_group(self) -> list[ServerRecord]:
        """Gives the segment's records as its servers see themselves now (`info`), this server's own included;
        a member that does not answer is left out of this look. Notes what their demands count twice."""
        fresh, refused, opened = [], [], []
        for record in await self._group(max_age_s=GROUP_MAX_AGE_S):
            if record.peer_id == self.server.peer_id:
                fresh.append(self.server.record())
                refused.append(refused_digests(self.server.hosting.sessions.refused()))
                opened += opened_digests(self.server.hosting.sessions.opened())
                continue
            try:
                reply = await (await self._connection(record)).call("info", {},
                                                                    timeout=self.server.config.push_timeout_s)
            except (PeerUnreachable, TimeoutError, OSError):
                continue
            member = ServerRecord.from_wire(reply.get("record"))
            if member is not None and member.peer_id == record.peer_id:
                fresh.append(member)
                dropping = reply.get("dropping")
                named = dropping.get("refused") if isinstance(dropping, dict) else None
                refused.append(named if isinstance(named, dict) else {})
                done = dropping.get("opened") if isinstance(dropping, dict) else None
                opened += done if isinstance(done, list) else []
        self._refused_twice = refused_twice(refused, opened)
        return fresh

    async def _ask_to_drop(self, peer_id: str, start: int, end: int, reserve: int) -> None:
        if peer_id == self.server.peer_id:
            await self.server.drop_blocks(start, end, reserve_pages=reserve)
            return
        await self._call(peer_id, "drop", {"blocks": [start, end], "reserve": reserve})

    async def _ask_to_restore(self, peer_id: str, evict_merged: bool) -> bool:
        if peer_id == self.server.peer_id:
            had_blocks = self.server.hosting.restorable is not None
            await self.server.restore_blocks(evict_merged=evict_merged)
            return had_blocks
        return restored_of(await self._call(peer_id, "restore", {"evict_merged": evict_merged}))

    async def _call(self, peer_id: str, method: str, payload: dict[str, object]) -> dict[str, Any]:
        record = self._view[1].get(peer_id)
        if record is None:
            raise PeerUnreachable(f"server {peer_id} is not in this server's view of the DHT")
        # a restore loads blocks: it may take as long as a range change
        return await (await self._connection(record)).call(method, payload,
                                                           timeout=self.server.config.block_change_timeout_s)

    async def _connection(self, record: ServerRecord) -> RpcConnection:
        server = self.server
        connection = self._connections.get(record.peer_id)
        if connection is None or connection.is_closed:
            if server.p2p is None:
                raise PeerUnreachable("this server is not connected yet")
            connection = self._connections[record.peer_id] = await dial(
                server.p2p, record.peer_id, list(record.addrs), timeout=server.config.push_timeout_s,
                max_frame_bytes=server.config.max_frame_bytes)
        return connection
