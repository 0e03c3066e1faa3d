"""A server's part in the KV packing of its segment: whether it takes new sessions, its reports, and, when it leads
the servers that host exactly its blocks (without an orchestrator), the segment's loop
(`orchestrator.packing.segment_loop`).

The leader (the orchestrator the server follows, or else the lowest peer id of the segment) calls `kv_report` every
epoch: the member answers with its capacity and sessions and takes new sessions or stands by as the leader says. A
standby whose leader goes silent for `ORPHAN_EPOCHS` epochs takes sessions again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from hivemind import DHT
from hivemind.p2p import P2P

from orchestrator.packing.segment_loop import (
    ORPHAN_EPOCHS,
    Report,
    SegmentPackingLoop,
    group_of,
    leader_of,
    packing_capacity,
)
from server.config import ServerConfig
from server.hosting import Hosting
from server.migration import Migrations, MoveChoice
from server.sessions import Session, SessionTable
from swarm.dht import lookup_servers_async
from swarm.errors import AssignmentRefused, PeerUnreachable
from swarm.memory import PagePool
from swarm.model import BlockRange, ModelSource
from swarm.records import ServerRecord
from swarm.rpc import CallContext, RpcConnection, dial
from swarm.wire import field

log = logging.getLogger(__name__)


class PackingHost(Protocol):
    """What a packing member needs of its server (`server.server.SwarmServer`)."""

    config: ServerConfig
    source: ModelSource
    blocks: BlockRange
    hosting: Hosting
    pool: PagePool
    sessions: SessionTable
    migrations: Migrations
    dht: DHT | None
    p2p: P2P | None

    @property
    def peer_id(self) -> str: ...

    def record(self) -> ServerRecord: ...

    def announce_soon(self) -> None: ...

    async def announced_addrs(self, peer_id: str, block: int) -> list[str] | None: ...

    async def migrate_session(self, session: Session, peer_id: str, mode: str = ...) -> MoveChoice: ...


class PackingMember:
    """The packing state and RPCs of one server (`server.server.SwarmServer`, which it serves)."""

    def __init__(self, server: PackingHost) -> None:
        self.server = server
        self.accepting = True  # takes new sessions; False: a standby its segment's packing emptied
        self._told_s = 0.0  # when its segment's leader last said whether it takes sessions
        self._group_view: tuple[float, list[ServerRecord]] = (0.0, [])  # (when, the servers of its segment)
        self._connections: dict[str, RpcConnection] = {}  # to the members of its segment
        self.loop: SegmentPackingLoop | None = None  # the segment's loop, run by every server without orchestrator

    def start(self) -> asyncio.Task[None] | None:
        """Starts the segment's loop (it acts only while this server leads), for a server without orchestrator."""
        config = self.server.config
        if not config.kv_packing or config.orchestrators:
            return None
        self.loop = SegmentPackingLoop(
            config.kv_packing, peer_id=self.server.peer_id, epoch_s=config.packing_epoch_s,
            kv_bytes_per_token=lambda blocks: self.server.blocks.kv_bytes_per_token() * blocks,
            group=lambda: self.segment_group(max_age_s=0.0), report=self._member_report, migrate=self._ask_to_migrate,
        )
        return asyncio.create_task(self.loop.run(), name="segment-packing")

    async def close(self) -> None:
        for connection in self._connections.values():
            await connection.close()

    def check_orphaned(self) -> None:
        """Takes sessions again if it stands by and its segment's leader went silent."""
        if not self.accepting and time.monotonic() - self._told_s > ORPHAN_EPOCHS * self.server.config.packing_epoch_s:
            self.set_accepting(True)

    async def segment_group(self, *, max_age_s: float = 2.0) -> list[ServerRecord]:
        """Gives the online servers hosting exactly this server's blocks, itself included (cached `max_age_s`)."""
        when, group = self._group_view
        if time.monotonic() - when <= max_age_s:
            return group
        server = self.server
        assert server.dht is not None
        records = await lookup_servers_async(server.dht, server.source.model_id, timeout_s=server.config.push_timeout_s)
        records[server.peer_id] = server.record()
        group = group_of(records, server.hosting.start, server.hosting.end)
        self._group_view = (time.monotonic(), group)
        return group

    async def leads_me(self, peer_id: str) -> bool:
        """Gives whether `peer_id` leads this server's segment (by this server's own view of the DHT)."""
        if not self.server.config.kv_packing or peer_id == self.server.peer_id:
            return False
        group = await self.segment_group()
        if peer_id not in {record.peer_id for record in group}:
            group = await self.segment_group(max_age_s=0.0)
        return leader_of(group) == peer_id

    async def kv_report(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """Answers its segment's leader with its KV capacity and sessions, and takes new sessions or stands by as
        the leader says (`accepting`)."""
        server = self.server
        if ctx.peer_id not in server.config.orchestrators and not await self.leads_me(ctx.peer_id):
            raise AssignmentRefused(f"{ctx.peer_id} is neither an orchestrator of server {server.peer_id} nor the "
                                    f"leader of its segment")
        self.set_accepting(field(payload, "accepting", bool, optional=True) is not False)
        return self.own_report()

    def own_report(self) -> dict[str, Any]:
        server = self.server
        stats = server.pool.stats()
        # a session still arriving is its source's; one that is leaving is still here until the move commits
        sessions = [{"session_id": s.session_id, "pages": server.sessions.packed_pages(s), "tokens": s.position,
                     "settling": s.settling, "lease_id": s.lease_id}
                    for s in server.sessions if s.importing_from is None]
        kv_pages = stats.pages_total - stats.pages_params
        blocks = server.sessions.block_end - server.sessions.block_start
        return {"capacity_pages": packing_capacity(kv_pages, blocks), "sessions": sessions,
                "links": server.migrations.links.known()}

    def set_accepting(self, accepting: bool) -> None:
        self._told_s = time.monotonic()
        if accepting != self.accepting:
            self.accepting = accepting
            log.info("%s new sessions (its segment's packing)", "Takes" if accepting else "Stands by for")
            self.server.announce_soon()

    async def _member_report(self, peer_id: str, accepting: bool) -> Report:
        """Gives a member's report for the leader's epoch (this server's own without a call)."""
        if peer_id == self.server.peer_id:
            self.set_accepting(accepting)
            reply = self.own_report()
        else:
            connection = await self._connection(peer_id)
            reply = await connection.call("kv_report", {"accepting": accepting},
                                          timeout=self.server.config.push_timeout_s)
        return Report.from_wire(peer_id, reply)

    async def _ask_to_migrate(self, source: str, session_id: str, destination: str, mode: str) -> None:
        """Moves a session of its segment: its own directly, a member's through that member's `migrate`."""
        server = self.server
        if source == server.peer_id:
            await server.migrate_session(server.sessions.get(session_id), destination, mode)
            return
        connection = await self._connection(source)
        await connection.call("migrate", {"session_id": session_id, "peer_id": destination, "mode": mode},
                              timeout=server.config.push_timeout_s * 6)

    async def _connection(self, peer_id: str) -> RpcConnection:
        server = self.server
        connection = self._connections.get(peer_id)
        if connection is None or connection.is_closed:
            addrs = await server.announced_addrs(peer_id, server.hosting.start)
            if addrs is None or server.p2p is None:
                raise PeerUnreachable(f"server {peer_id} announces no block {server.hosting.start}")
            connection = self._connections[peer_id] = await dial(
                server.p2p, peer_id, addrs, timeout=server.config.push_timeout_s,
                max_frame_bytes=server.config.max_frame_bytes)
        return connection
