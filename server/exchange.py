"""KunServe's KV exchange on one server (Sec. 4.2, spec 3.5, 3.6 and 5.4).

After a drop, the sessions running here over blocks this server dropped (its victims) hand those blocks, with their
KV, to servers that keep them, and go on as a chain through them: the session's pages for the dropped blocks travel
by the migration mechanism (`server.migration`, a prefix or suffix of the session: a split), the part that stays
here keeps the session's id, and the client learns the new chain from the next step (`ChainChanged`) and goes on
without a replay. Blocking exchange (the paper's): from the drop on, every victim's steps wait until its KV has
moved, so nothing computes over the dropped blocks any more and their parameter pages are free at once (those of a
batch computing at the drop, once it ends), for new sessions and for the KV the group-mates' victims bring (spec
5.2's transient). A victim's prompt computing at the drop stops where its batch ends (`StepScheduler.stop_step`): its
KV moves as it was before the prompt, and the client sends the prompt again through the new chain [chainswarm: until
stop 57 the prompt computed on over every block, and the dropped blocks stayed loaded until it ended: 1.7 s in r39,
in which new sessions were refused]. Victims then go one by one, smallest first (`exchange_order`), each stalled
from the drop until its own KV has moved [chainswarm: until stop 44 each victim computed on until its own turn,
which kept the dropped blocks loaded until the last victim had left them: 2-4 s after a drop in which the burst's
arrivals found "0 are free"]. A victim goes by replay instead (it is evicted with `BlocksDropped` and its client replays
it through the keepers) where `exchange_mode` expects that to end sooner, where no keeper has room for it
within `EXCHANGE_DEADLINE_S`, or with `--kv-exchange replay`; under `auto` every victim waits from the drop as under
`blocking`, until it moved or was evicted. With `--kv-exchange live`, no victim waits: each goes on at once through
the keepers, which have this server attend over the KV until it has followed
(`server.remote_attention`); their lends go all at once (they move no KV, and the keeper takes no pages for them
until their KV follows), and the dropped blocks unload as soon as the last one is lent.

After a restore, the sessions that run here and on into a buddy (as the client's last step named the next server)
take the buddy's part back (a merge): this server holds the session's steps, asks the buddy to `export` its part
at the session's position, and the buddy sends the KV into this session; steps sent on the old chain get
`ChainChanged` naming the one server. The upstream part pulls, so two restoring buddies never pull from each other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from hivemind import DHT
from hivemind.p2p import P2P

from orchestrator.buddy.exchange import exchange_mode
from orchestrator.packing.migration_split import MigrationCosts
from server.config import ServerConfig
from server.hosting import Hosting
from server.migration import Migrations, Part
from server.remote_attention import RemoteAttention
from server.scheduler import StepScheduler
from server.sessions import Session, SessionTable
from swarm.dht import lookup_servers_async
from swarm.errors import BlocksDropped, Hop, MigrationRefused, PeerUnreachable, SwarmError
from swarm.model import BlockRange, ModelSource
from swarm.records import ServerRecord, ServerState
from swarm.rpc import CallContext, dial
from swarm.wire import field

log = logging.getLogger(__name__)

ExchangeSetting = Literal["auto", "blocking", "live", "replay"]
EXCHANGE_SETTINGS: tuple[ExchangeSetting, ...] = ("auto", "blocking", "live", "replay")
EXCHANGE_DEADLINE_S = 30.0  # a victim no keeper takes within this is evicted: its client replays it
# No victim moved for this long: the rest are evicted for a replay. Buddies whose pools are full wait on each other:
# each keeper's free pages come from the parameters of the blocks it dropped (under `live`, these stay until its
# own victims left) and from the KV its victims take away.
EXCHANGE_STUCK_S = 2.0
RETRY_S = 0.25  # between two rounds over the victims that no keeper had room for
# A restore takes the sessions' next parts back tail first; a part that is not its chain's last waits this long
# for the parts after it, then goes anyway. Rounds over the sessions MERGE_ROUND_S apart, until MERGE_IDLE_S pass
# without a merge (each merge that a chain's merge behind it made possible comes a client's step later).
MERGE_WAIT_S, MERGE_ROUND_S, MERGE_IDLE_S = 3.0, 0.1, 15.0
TBT_SLACK_MS = 0.0  # `auto` never picks remote attention (spec 5.4: one round trip per block and token it has not
# moved, where a WAN's RTT dwarfs a block's compute); `--kv-exchange live` takes it for every victim


class ExchangeHost(Protocol):
    """What the exchange needs of its server (`server.server.SwarmServer`)."""

    config: ServerConfig
    source: ModelSource
    hosting: Hosting
    sessions: SessionTable
    migrations: Migrations
    remote: RemoteAttention
    scheduler: StepScheduler
    blocks: BlockRange
    dht: DHT | None
    p2p: P2P | None
    dtype: torch.dtype

    @property
    def peer_id(self) -> str: ...

    def record(self) -> ServerRecord: ...

    def announce_soon(self) -> None: ...

    async def announce_now(self) -> None: ...

    async def announced_addrs(self, peer_id: str, block: int) -> list[str] | None: ...

    def move_costs_of(self, session: Session, peer_id: str, rtt_s: float, destination: ServerRecord | None, *,
                      kv_blocks: int | None = None) -> MigrationCosts: ...


@dataclass
class ExchangeStats:
    """What the exchanges of this server did: victims, how each went, and the merges after restores."""

    victims: int = 0
    moved: int = 0  # victims whose dropped blocks' KV reached a keeper (no replay)
    replayed: int = 0  # victims evicted for their client to replay
    merged: int = 0  # sessions that took a buddy's part back after a restore
    merge_failed: int = 0
    stall_ms_max: float = 0.0  # the longest a victim's steps waited for its KV to move
    stall_ms_total: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return {"victims": self.victims, "moved": self.moved, "replayed": self.replayed, "merged": self.merged,
                "merge_failed": self.merge_failed, "stall_ms_max": round(self.stall_ms_max, 3),
                "stall_ms_mean": round(self.stall_ms_total / self.moved, 3) if self.moved else 0.0}


class BlockExchange:
    """Runs the exchange after each drop and the merges after each restore, one at a time."""

    def __init__(self, server: ExchangeHost, setting: ExchangeSetting = "auto") -> None:
        self.server, self.setting = server, setting
        self.stats = ExchangeStats()
        self._task: asyncio.Task[None] | None = None
        # blocking victims whose steps wait for their KV to move, and since when (perf_counter)
        self._waiting: dict[str, tuple[Session, float]] = {}

    @property
    def reshaping(self) -> bool:
        """Gives whether an exchange or a merge runs now."""
        return self._task is not None and not self._task.done()

    def after_drop(self, victims: list[str]) -> None:
        """Starts moving `victims` (sessions over blocks just dropped) to the servers that keep those blocks.

        Blocking and auto (the paper's blocking exchange, spec 3.5 and 5.2): from now on the victims' steps wait until
        their KV moved (or they were evicted for a replay), so no victim computes over the dropped blocks any more,
        and their parameter pages are free at once (those of a batch computing now, once it ends: a victim's prompt
        stops there and is sent again through the new chain) for new sessions and the group-mates' victims. Under
        `live`, victims with no KV yet wait and move so too (`_mode`)."""
        now = time.perf_counter()
        for session_id in victims:
            session = self._open(session_id)
            if session is None:
                continue
            waits = self.setting in ("blocking", "auto") or self._nothing_to_lend(session)
            if waits and session.awaiting_exchange is None:
                session.awaiting_exchange = asyncio.get_running_loop().create_future()
                self._waiting[session_id] = (session, now)
                self.server.scheduler.stop_step(session)  # a prompt computing here goes on through the keepers
        self.server.hosting.unload_unused()
        self._run(self._exchange(victims), "kv-exchange")

    def after_restore(self) -> None:
        """Starts taking back the buddies' parts of the sessions that run on into them, until the next drop (whose
        exchange runs after the merges: its victims' steps must not wait for merges that it makes moot)."""
        self._run(self._merge_all(self.server.hosting.drops), "kv-merge")

    def _run(self, work: Any, name: str) -> None:
        previous = self._task

        async def in_turn() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            self.server.announce_soon()
            try:
                await work
            except Exception:  # a bug must not pass silently; the sessions it left go on or time out as before
                log.exception("%s failed", name)
            finally:
                self.server.announce_soon()

        self._task = asyncio.create_task(in_turn(), name=name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for session_id in list(self._waiting):
            self._release(session_id)

    def _open(self, session_id: str) -> Session | None:
        try:
            return self.server.sessions.get(session_id)
        except SwarmError:  # closed or evicted meanwhile
            return None

    def _release(self, session_id: str) -> None:
        """Lets a blocking victim's waiting steps go on: to where its KV went, to its eviction, or here."""
        entry = self._waiting.pop(session_id, None)
        if entry is None:
            return
        session = entry[0]
        waiting, session.awaiting_exchange = session.awaiting_exchange, None
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    # ---- victims of a drop

    async def _exchange(self, victims: list[str]) -> None:
        try:
            await self._move_all(victims)
        finally:  # whatever ended the exchange, no victim's steps wait for it any more
            for session_id in victims:
                self._release(session_id)
            self.server.hosting.unload_unused()

    async def _move_all(self, victims: list[str]) -> None:
        server = self.server
        pending = self._by_size(victims, server.hosting.serving)
        self.stats.victims += len(pending)
        deadline = time.monotonic() + EXCHANGE_DEADLINE_S
        stuck = time.monotonic() + EXCHANGE_STUCK_S
        unreachable: set[str] = set()  # keepers that could not be dialled (gone, their records not yet expired)
        while pending:
            kept = server.hosting.serving  # a restore meanwhile leaves nothing to move
            records = [r for r in await self._records() if r.peer_id not in unreachable]
            if self.setting == "live":  # a lend moves no KV: every victim goes on through its keeper at once
                outcomes = await asyncio.gather(*(self._attempt(s, kept, records, unreachable) for s in pending))
                server.hosting.unload_unused()
            else:  # the KV moves one victim after another, smallest first
                outcomes = [await self._attempt(session, kept, records, unreachable) for session in pending]
            if "moved" in outcomes:
                stuck = time.monotonic() + EXCHANGE_STUCK_S
            pending = [session for session, outcome in zip(pending, outcomes, strict=True) if outcome == "retry"]
            now = time.monotonic()
            if pending and (now > deadline or now > stuck):
                why = ("no server that keeps its blocks took its KV in time" if now > deadline else
                       f"no victim's KV found room on a keeper for {EXCHANGE_STUCK_S:g} s")
                for session in pending:
                    self._evict(session, kept, why)
                    self._release(session.session_id)
                log.info("Exchange: %d victim(s) evicted for a replay (%s)", len(pending), why)
                break
            if pending:
                await asyncio.sleep(RETRY_S)

    async def _attempt(self, session: Session, kept: tuple[int, int], records: list[ServerRecord],
                       unreachable: set[str]) -> Literal["moved", "retry", "gone"]:
        """Tries to move one victim; gives whether it moved (or was evicted for a replay), must be tried again
        (no keeper took it; an unreachable keeper joins `unreachable`), or needs nothing any more."""
        if not self.server.sessions.is_open(session) or not _parts_outside(session, kept):
            self._release(session.session_id)  # closed, or a restore brought its blocks back
            return "gone"
        try:
            replayed = self.stats.replayed
            if not await self._move_victim(session, kept, records):
                return "retry"
        except SwarmError as error:
            log.info("Exchange: session %s could not move (%s: %s)", session.session_id, type(error).__name__,
                     error.message)
            if isinstance(error, PeerUnreachable) and error.details.get("peer_id"):
                unreachable.add(str(error.details["peer_id"]))
            return "retry"
        if self.stats.replayed == replayed:  # it moved (`auto` may have evicted it for a replay)
            self._note_waited(session.session_id)
        self._release(session.session_id)
        return "moved"

    def _note_waited(self, session_id: str) -> None:
        """Counts a blocking victim's stall: from the drop until its KV moved."""
        entry = self._waiting.get(session_id)
        if entry is not None:
            self._note_stall((time.perf_counter() - entry[1]) * 1000)

    def _note_stall(self, stall_ms: float) -> None:
        self.stats.stall_ms_max = max(self.stats.stall_ms_max, stall_ms)
        self.stats.stall_ms_total += stall_ms

    def _by_size(self, victims: list[str], kept: tuple[int, int]) -> list[Session]:
        """Gives the open victims, the least KV to move first (ties: session id)."""
        sessions = [session for session in map(self._open, victims) if session is not None]
        return sorted(sessions, key=lambda s: (s.position * s.batch * _dropped_blocks(s, kept), s.session_id))

    async def _move_victim(self, session: Session, kept: tuple[int, int], records: list[ServerRecord]) -> bool:
        """Moves the blocks of `session` outside `kept` to keepers, one part at a time; gives False when a part
        found no keeper with room (try again later). A victim whose parts go by replay is evicted."""
        for start, end in _parts_outside(session, kept):
            keeper = _keeper(records, start, end, self.server.peer_id)
            if keeper is None:
                return False
            mode = await self._mode(session, keeper, start, end)
            if mode == "replay":
                self._evict(session, kept, "its client replays it sooner than its KV would move")
                return True
            stalled = time.perf_counter()
            if mode == "live":
                await self.server.remote.lend(session, keeper.peer_id, keeper.addrs, start, end,
                                              self._hops_after(session, keeper, start, end))
            else:
                await self._send_part(session, keeper, start, end)
            if session.session_id not in self._waiting:  # a blocking victim's stall began at the drop
                self._note_stall((time.perf_counter() - stalled) * 1000)
        self.stats.moved += 1
        return True

    def _hops_after(self, session: Session, keeper: ServerRecord, start: int, end: int) -> list[Hop]:
        """Gives the chain `session` runs on once its blocks [start, end) went from here to `keeper`."""
        me = Hop(self.server.peer_id, session.start, session.end, session.session_id)
        around = session.hops or [me]
        staying = [Hop(me.peer_id, session.start, start, session.session_id)] if session.start < start else []
        staying += [Hop(me.peer_id, end, session.end, session.session_id)] if end < session.end else []
        leaving = Hop(keeper.peer_id, start, end, session.session_id)
        return sorted([hop for hop in around if hop.peer_id != me.peer_id] + staying + [leaving],
                      key=lambda hop: hop.start)

    async def _send_part(self, session: Session, keeper: ServerRecord, start: int, end: int) -> None:
        server = self.server
        assert server.p2p is not None
        hops = self._hops_after(session, keeper, start, end)
        try:
            connection = await dial(server.p2p, keeper.peer_id, keeper.addrs, timeout=server.config.push_timeout_s,
                                    max_frame_bytes=server.config.max_frame_bytes)
        except PeerUnreachable as error:
            raise PeerUnreachable(error.message, {"peer_id": keeper.peer_id}) from None
        try:
            await server.migrations.send(session, connection, keeper.addrs, timeout_s=server.config.push_timeout_s,
                                         part=Part(start, end, hops))
        finally:
            await connection.close()

    def _nothing_to_lend(self, session: Session) -> bool:
        """Gives whether `session`, a victim under `live`, has no KV yet, so it moves as under `blocking` (waiting
        from the drop, with no bytes: a prompt computing at the drop stopped where its batch ended) instead of being
        lent: there is nothing to attend over here, and lent, its prompt would send every block's queries, keys and
        values to this server (r39: a 256-token prompt came 6.2 s after it arrived)."""
        return self.setting == "live" and session.position == 0

    async def _mode(self, session: Session, keeper: ServerRecord, start: int, end: int) -> str:
        if self._nothing_to_lend(session):
            return "blocking"
        if self.setting != "auto":
            return self.setting  # blocking, live or replay for every victim
        # the KV of the part, against a replay of the whole session through the keepers' chain
        costs = self.server.move_costs_of(session, keeper.peer_id, 0.0, keeper, kv_blocks=end - start)
        return exchange_mode(costs, session.position, rtt_ms=0.0, pending_blocks=end - start,
                             tbt_slack_ms=TBT_SLACK_MS)

    def _evict(self, session: Session, kept: tuple[int, int], why: str) -> None:
        if self.server.sessions.evict(session.session_id, BlocksDropped(
            f"this server dropped blocks of session {session.session_id!r} and keeps {kept[0]}:{kept[1]} only "
            f"({why}); continue through the servers that keep the others"
        )):
            self.stats.replayed += 1

    async def _records(self) -> list[ServerRecord]:
        server = self.server
        if server.dht is None:
            return []
        try:
            found = await lookup_servers_async(server.dht, server.source.model_id,
                                               timeout_s=server.config.push_timeout_s)
        except SwarmError as error:
            log.info("Exchange: no servers found in the DHT (%s)", error.message)
            return []
        return [record for record in found.values() if record.state == ServerState.online]

    # ---- merges after a restore

    async def _merge_all(self, drops: int) -> None:
        """Takes back the next parts of the sessions here, tail first: a part is pulled once it is its chain's last,
        after the servers behind it took theirs back (so two merges never chain through one part at once), or
        after `MERGE_WAIT_S` whatever it is. The client names every server after this one in each step, and after
        a merge behind, its next step here names the grown part; so this runs in rounds until no session here has
        a next part within the restored blocks, or `MERGE_IDLE_S` passed without a merge. Each part (peer, session,
        end) is tried once: a part that refused because it grew meanwhile is tried again once a step names its new
        end. [A CI failure on a loaded machine: the first server asked for the second's part 2:4 after the 3 s
        wait, as that part took 4:8 back; it refused, the next step that named 2:8 came more than a round later,
        and the rounds had ended.] The rounds end at once when the server dropped blocks again since the restore
        (`drops`, the hosting's count then): the sessions not merged yet run on through their buddies' parts."""
        server = self.server
        await server.announce_now()  # a buddy gives its part back only to a server that announces the blocks
        began = last_merge = time.monotonic()
        tried: set[tuple[str, str, int]] = set()
        while time.monotonic() - last_merge < MERGE_IDLE_S:
            start, end = server.hosting.serving
            waiting = False
            for session in list(server.sessions):
                if server.hosting.drops != drops:
                    log.info("Restore: blocks were dropped again; the sessions not merged yet stay on their chains")
                    return
                hop = session.next_hop
                if (hop is None or hop.peer_id == server.peer_id or hop.start != session.end or hop.end is None
                        or not (start <= session.start and hop.end <= end) or session.merging is not None
                        or session.importing_from is not None or session.closed):
                    continue
                if (session.session_id, hop.session_id, hop.end) in tried:
                    waiting = True  # a part that grew since (a merge behind it) shows in the session's next step
                    continue
                if session.later_hops > 1 and time.monotonic() - began < MERGE_WAIT_S:
                    waiting = True  # the parts after the next one are merging first
                    continue
                tried.add((session.session_id, hop.session_id, hop.end))
                waiting = True  # its next step may name a further part to take
                try:
                    await self._pull(session, hop.peer_id, hop.session_id, hop.end)
                    self.stats.merged += 1
                    last_merge = time.monotonic()
                except SwarmError as error:
                    self.stats.merge_failed += 1
                    log.info("Restore: session %s stays on its chain through %s (%s: %s)", session.session_id,
                             hop.peer_id, type(error).__name__, error.message)
            if not waiting:
                return
            await asyncio.sleep(MERGE_ROUND_S)

    async def _pull(self, session: Session, peer_id: str, remote_id: str, remote_end: int) -> None:
        """Takes blocks [session.end, remote_end) of `session` back from `peer_id` (its session `remote_id`)."""
        server = self.server
        assert server.p2p is not None
        addrs = await server.announced_addrs(peer_id, session.end)
        if addrs is None:
            raise PeerUnreachable(f"server {peer_id} announces no block {session.end}")
        connection = await dial(server.p2p, peer_id, addrs, timeout=server.config.push_timeout_s,
                                max_frame_bytes=server.config.max_frame_bytes)
        if session.moving is not None:
            await connection.close()
            raise MigrationRefused(f"session {session.session_id!r} is moving already")
        moving = session.moving = asyncio.get_running_loop().create_future()  # its steps wait for the merge
        try:
            await server.migrations.quiesce(session)
            first = session.end
            await connection.call("export", {
                "session_id": remote_id, "into": session.session_id, "position": session.position,
                "to": [session.start, remote_end],
            }, timeout=server.config.block_change_timeout_s)
        finally:
            session.moving = None
            moving.set_result(None)
            await connection.close()
        log.info("Restore: session %s took blocks %d:%d back from %s", session.session_id, first, remote_end,
                 peer_id)

    async def export(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """RPC: sends this server's part of a session into the caller's session `into` next to it (a merge the
        caller asked for after its restore), once the part is at `position`; the caller must announce the blocks."""
        server = self.server
        session = server.sessions.get(field(payload, "session_id", str))
        into = field(payload, "into", str)
        position = field(payload, "position", int)
        to = field(payload, "to", list)
        if len(into) > 128 or len(to) != 2 or not all(isinstance(b, int) for b in to):
            raise MigrationRefused("export needs 'into' (a session id) and 'to', the merged [start, end]")
        if not (to[0] < session.start and to[1] == session.end):
            raise MigrationRefused(f"blocks {to[0]}:{to[1]} do not end with session {session.session_id!r}'s "
                                   f"{session.start}:{session.end}")
        addrs = await server.announced_addrs(ctx.peer_id, session.start)
        if addrs is None or await server.announced_addrs(ctx.peer_id, session.end - 1) is None:
            raise MigrationRefused(f"server {ctx.peer_id} does not announce blocks {session.start}:{session.end}")
        assert server.p2p is not None
        connection = await dial(server.p2p, ctx.peer_id, addrs, timeout=server.config.push_timeout_s,
                                max_frame_bytes=server.config.max_frame_bytes)
        try:
            await server.migrations.send(
                session, connection, addrs, timeout_s=server.config.push_timeout_s,
                part=Part(session.start, session.end, [Hop(ctx.peer_id, to[0], to[1], into)], into=into,
                          position=position),
            )
        finally:
            await connection.close()
        return {"blocks": to}


def _dropped_blocks(session: Session, kept: tuple[int, int]) -> int:
    return sum(end - start for start, end in _parts_outside(session, kept))


def _parts_outside(session: Session, kept: tuple[int, int]) -> list[tuple[int, int]]:
    """Gives the block ranges of `session` outside `kept`: a prefix and/or a suffix (all of it if they miss)."""
    if session.end <= kept[0] or kept[1] <= session.start:
        return [(session.start, session.end)]
    parts = []
    if session.start < kept[0]:
        parts.append((session.start, kept[0]))
    if kept[1] < session.end:
        parts.append((kept[1], session.end))
    return parts


def _keeper(records: list[ServerRecord], start: int, end: int, me: str) -> ServerRecord | None:
    """Gives the online server, not `me`, that hosts [start, end) with the most free pages in its record. Whether it
    has room is for its admission to say (`ServerBusy`): the records lag behind the pages an exchange frees, and
    buddies free theirs for each other (each victim that leaves a member frees KV pages there, which the member
    holds for its mates' victims), so a record read before that would evict victims that would fit."""
    hosts = [r for r in records if r.peer_id != me and r.block_start <= start and end <= r.block_end]
    return max(hosts, key=lambda r: (r.pages_free, r.peer_id), default=None)
