"""Live migration: a running session moves to another server that hosts its blocks, and goes on there with the same
tokens. Two modes, as MELL's adaptive migration has them: KV transfer (the pages travel, no replay) and replay (the
client re-sends its saved inputs and the destination recomputes the KV).

KV transfer:

The source (`Migrations.send`) waits until the session's running step is done and no batch uses its pages, then
holds its steps (they wait), and talks to the destination over one stream:
1. `import_open`: the destination opens the session with pages for its whole history (its headroom rule decides,
   `ServerBusy` otherwise) and marks it as importing from this source: it takes no steps yet;
2. `import_kv`, frame by frame: pieces, each the keys and values of tokens [start, end) of one block and row, at
   most `chunk_bytes` a frame (`--migration-chunk-size`, default `KV_CHUNK_BYTES`); the event loop serves other
   sessions' steps between two frames;
3. `import_commit`: the destination sets the session's position and last step (so a step the source already
   computed is answered again, not recomputed) and serves it from then on.
Only then the source frees the session's pages and keeps a tombstone: every later step of the session gets
`SessionMoved` naming the destination, and the client switches to it. A failure at any point before the commit's
reply leaves the session whole on the source (it goes on there) and asks the destination to drop what it took; an
import whose source went silent is dropped after `import_idle_s` (`--import-idle-timeout`). Only the server that
opened an import may write into it, commit or abort it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from orchestrator.packing.migration_split import KV_CHUNK_BYTES, Mode, announced_bytes_per_s
from server.sessions import Session, SessionTable, StepResult
from swarm.errors import (
    BlocksNotHosted,
    ChainChanged,
    Hop,
    InvalidTensor,
    MigrationRefused,
    SessionMoved,
    SessionNotFound,
    SwarmError,
)
from swarm.memory import kv_bytes_per_token
from swarm.model.paged_kv import PagedKV
from swarm.rpc import RpcConnection
from swarm.wire import decode_tensor, encode_tensor

log = logging.getLogger(__name__)

IMPORT_IDLE_S = 30.0  # an import that received nothing this long is dropped (its source died)
MOVED_TTL_S = 900.0  # how long a source remembers where a session went
MAX_MOVED = 4096
MAX_PIECES_PER_FRAME = 65536  # an import_kv frame's pieces (one per block and row at least)
STEP_WAIT_S = 30.0  # how long a move waits for the session's running step to finish
POLL_S = 0.005
PEER_CALL_TIMEOUT_S = 10.0  # a close or an abort this server sends a peer about a session it moved or lent
MODES: tuple[Mode, ...] = ("kv", "replay")
AUTO = "auto"  # a move's mode chosen by `choose_mode` from measured costs
MIN_BANDWIDTH_SAMPLE_BYTES = 256 << 10  # transfers smaller than this say little about a link's bandwidth


class LinkEstimates:
    """Per peer, the bandwidth this server's KV transfers to it achieved (smoothed, the latest weighing most: links
    change)."""

    def __init__(self) -> None:
        self._bytes_per_s: dict[str, float] = {}

    def note_transfer(self, peer_id: str, sent_bytes: int, seconds: float, waits_s: float) -> None:
        """Counts a transfer of `sent_bytes` over `seconds`, of which `waits_s` were round trips, not bytes."""
        busy_s = seconds - waits_s
        if sent_bytes < MIN_BANDWIDTH_SAMPLE_BYTES or busy_s <= 0:
            return
        sample = sent_bytes / busy_s
        previous = self._bytes_per_s.get(peer_id)
        self._bytes_per_s[peer_id] = sample if previous is None else 0.25 * previous + 0.75 * sample

    def known(self) -> dict[str, float]:
        """Gives the bandwidth measured so far to each peer (bytes/s)."""
        return dict(self._bytes_per_s)

    def bytes_per_s(self, peer_id: str, *measured_mbps: float | None) -> float:
        """Gives the link's bandwidth to `peer_id`: measured on transfers, else the lowest of `measured_mbps`
        (each side's measured inbound throughput), else DEFAULT_LINK_MBPS."""
        known = self._bytes_per_s.get(peer_id)
        return known if known is not None else announced_bytes_per_s(*measured_mbps)


@dataclass(frozen=True)
class Part:
    """The blocks [start, end) of a session that a move sends (a prefix or suffix of what it holds: a split), or,
    with `into`, adds to the destination's session `into` next to them (a merge); once at the destination, the
    session's blocks run on `hops`, which the source answers steps that expected the session whole with. With
    `position`, the move waits until the session is there (its peer's part, which the merge joins, is)."""

    start: int
    end: int
    hops: list[Hop]
    into: str | None = None
    position: int | None = None


@dataclass(frozen=True)
class _Departure:
    """Where a session that left went: a server (`peer_id`, its `addrs`, by `mode`), or, merged into a peer's part
    of it, the `hops` that run it now at `position`."""

    peer_id: str
    addrs: list[str]
    mode: Mode
    when: float
    hops: list[Hop]
    position: int


@dataclass(frozen=True)
class MoveChoice:
    """The mode a move took and, when `choose_mode` picked it, the seconds it expected of each mode."""

    mode: Mode
    kv_s: float | None = None
    replay_s: float | None = None

    def to_wire(self) -> dict[str, object]:
        expected = {} if self.kv_s is None else {"expected_s": {"kv": round(self.kv_s, 4),
                                                                "replay": round(self.replay_s or 0.0, 4)}}
        return {"mode": self.mode, **expected}


@dataclass
class MigrationStats:
    """Sessions moved in and out by mode, the KV bytes they carried and the time they took."""

    sessions_in: Counter[str] = field(default_factory=Counter)  # "kv" or "replay" -> sessions
    sessions_out: Counter[str] = field(default_factory=Counter)
    failed_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    ms_out: float = 0.0
    chosen: Counter[str] = field(default_factory=Counter)  # moves whose mode `choose_mode` picked, by mode
    held_steps: int = 0  # steps that arrived while their session's KV was leaving, and waited for the move

    def to_wire(self) -> dict[str, object]:
        return {"in": {mode: self.sessions_in[mode] for mode in MODES},
                "out": {mode: self.sessions_out[mode] for mode in MODES}, "failed_out": self.failed_out,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "ms_out": round(self.ms_out, 3),
                "chosen": {mode: self.chosen[mode] for mode in MODES}, "held_steps": self.held_steps}


async def close_remote(peer: RpcConnection, session_id: str) -> None:
    """Closes the part of `session_id` that a move or a lending opened on `peer` while its client closed the session
    here: no client would step or close it there."""
    try:
        await peer.call("close", {"session_id": session_id}, timeout=PEER_CALL_TIMEOUT_S)
    except SwarmError as error:  # it closes by itself once no step comes for the session timeout
        log.debug("could not close session %s on %s: %s", session_id, peer.peer_id, error.message)


class Migrations:
    """Both ends of live KV migration for one server: sending sessions away, importing them, and where they went."""

    def __init__(self, sessions: SessionTable, kv: PagedKV, dtype: torch.dtype, hidden_size: int, *,
                 chunk_bytes: int = KV_CHUNK_BYTES, import_idle_s: float = IMPORT_IDLE_S) -> None:
        self.sessions, self.kv, self.dtype, self.hidden_size = sessions, kv, dtype, hidden_size
        self.chunk_bytes, self.import_idle_s = chunk_bytes, import_idle_s
        self.stats = MigrationStats()
        self.links = LinkEstimates()
        self._moved: dict[str, _Departure] = {}  # sessions that left, by id
        self.peer_id = ""  # this server's, once it runs: the hop a session split or merged here names
        self.unclaimed: set[str] = set()  # moved sessions whose client has not yet been told where they went

    # ---- what steps see

    def check_step(self, session_id: str, blocks: tuple[int, int] | None = None) -> None:
        """Raises SessionMoved for a session that left this server, SessionNotFound for one still importing, and
        ChainChanged for a step that expects the session over `blocks` after the session was split or merged with a
        peer (or left, merged into one)."""
        session = self._find(session_id)
        moved = self._moved.get(session_id)
        if moved is not None and session is None:
            self.unclaimed.discard(session_id)
            if moved.hops:
                raise ChainChanged.to(moved.hops, moved.position)
            raise SessionMoved.to(session_id, moved.peer_id, moved.addrs, mode=moved.mode)
        if session is not None and session.importing_from is not None:
            raise SessionNotFound(f"session {session_id!r} is still arriving from {session.importing_from}")
        if session is not None and blocks is not None and blocks != (session.start, session.end):
            hops = session.hops or [Hop(self.peer_id, session.start, session.end, session_id)]
            session.untold = []  # its client learns the chain: it steps and closes every part of it itself
            raise ChainChanged.to(hops, session.position)

    async def wait_if_moving(self, session_id: str, blocks: tuple[int, int] | None = None) -> None:
        """Waits while the session's KV leaves, a peer's part of it arrives or it waits for the blocking exchange
        after a drop; raises as `check_step` does."""
        session = self._find(session_id)
        while session is not None and (waiting := session.moving or session.awaiting_exchange) is not None:
            self.stats.held_steps += 1
            await asyncio.shield(waiting)
            session = self._find(session_id)
        self.check_step(session_id, blocks)

    # ---- the source

    def token_bytes(self, session: Session) -> int:
        """Gives the KV bytes one token of `session` takes over all its blocks and rows."""
        return self.block_token_bytes() * (session.end - session.start) * session.batch

    async def send(self, session: Session, destination: RpcConnection, addrs: list[str], *, timeout_s: float,
                   rtt_s: float = 0.0, part: Part | None = None) -> None:
        """Moves `session` to the server at the other end of `destination` (see the module docstring), or only
        the blocks `part` names (a split or a merge); raises the typed error of a move that failed, the session then
        still whole here."""
        if session.moving is not None or session.importing_from is not None:
            raise SessionNotFound(f"session {session.session_id!r} is already moving")
        if session.remote is not None:
            raise MigrationRefused(f"session {session.session_id!r} still attends on {session.remote.lender}, which "
                                   f"holds some of its KV")
        start, end = (part.start, part.end) if part is not None else (session.start, session.end)
        if not (session.start <= start < end <= session.end and (start == session.start or end == session.end)):
            raise InvalidTensor(f"blocks {start}:{end} are not a prefix or suffix of the session's "
                                f"{session.start}:{session.end}")
        remote_id = part.into if part is not None and part.into else session.session_id
        started = time.perf_counter()
        if part is not None and part.position is not None:
            await self._reach(session, part.position)
        session.moving = asyncio.get_running_loop().create_future()
        sent_bytes, chunks, committed = 0, 0, False
        try:
            await self.quiesce(session)
            if part is not None and part.position is not None and session.position != part.position:
                raise SessionNotFound(f"session {session.session_id!r} is at position {session.position}, not at "
                                      f"{part.position} where its peer's part is")
            await destination.call("import_open", {
                "session_id": remote_id, "blocks": [start, end], "batch": session.batch,
                "max_length": session.max_length, "position": session.position, "client": session.opener,
                **({"lease_id": session.lease_id} if session.lease_id else {}),
                **({"merge": True} if part is not None and part.into else {}),
            }, timeout=timeout_s)
            chunks_started = time.perf_counter()
            for frame in self._frames(session, start, end):
                if not self.sessions.is_open(session):  # its client closed it meanwhile: its pages are gone
                    raise SessionNotFound(f"session {session.session_id!r} closed while it moved")
                pieces = [self._piece(session, *piece) for piece in frame]
                await destination.call("import_kv", {"session_id": remote_id, "pieces": pieces}, timeout=timeout_s)
                sent_bytes += sum(last - first for _, _, first, last in frame) * self.block_token_bytes()
                chunks += 1
            self.links.note_transfer(destination.peer_id, sent_bytes, time.perf_counter() - chunks_started,
                                     chunks * rtt_s)
            commit: dict[str, Any] = {"session_id": remote_id, "position": session.position}
            if end == session.end and session.last_step_id is not None and session.last_result is not None:
                commit["last_step_id"] = session.last_step_id  # the session's output is the destination's now
                commit["last_output"] = encode_tensor(session.last_result.output)
            await destination.call("import_commit", commit, timeout=timeout_s)
            committed = True
            if not self.sessions.is_open(session) and not (part is not None and part.into):
                await close_remote(destination, remote_id)  # its client closed it here during the commit
        except BaseException:
            self.stats.failed_out += 1
            if not committed:
                await self._abort_remote(destination, remote_id)
            raise
        finally:
            moving, session.moving = session.moving, None
            committed = committed and self.sessions.is_open(session)  # else its client closed it: nothing left here
            if committed and (start, end) == (session.start, session.end):
                hops = part.hops if part is not None else []
                self._remember(session.session_id, destination.peer_id, addrs, "kv", hops, session.position)
                self.sessions.close(session.session_id)
            elif committed:
                assert part is not None
                self.sessions.release_blocks(session, start, end)
                if not part.into:  # a merge's peer is in its client's chain already
                    session.untold.append((destination.peer_id, list(addrs)))
                session.hops = part.hops
                session.last_step_id, session.last_result = None, None  # its output now ends elsewhere
            moving.set_result(None)  # the waiting steps go on here, or learn where the session went
        self.stats.sessions_out["kv"] += 1
        self.stats.bytes_out += sent_bytes
        self.stats.ms_out += (time.perf_counter() - started) * 1000
        log.info("Moved session %s (blocks %d:%d, %d tokens, %d KV bytes) to %s in %.0f ms", session.session_id,
                 start, end, session.position, sent_bytes, destination.peer_id,
                 (time.perf_counter() - started) * 1000)

    async def _reach(self, session: Session, position: int) -> None:
        """Waits (within STEP_WAIT_S) until `session` computed the steps up to `position` that its client sent it
        (they arrive after its peer's part computed them); raises SessionNotFound if it went past or never got
        there."""
        deadline = time.monotonic() + STEP_WAIT_S
        while session.position < position or session.running is not None:
            if time.monotonic() > deadline or not self.sessions.is_open(session):
                break
            await asyncio.sleep(POLL_S)
        if session.position != position:
            raise SessionNotFound(f"session {session.session_id!r} is at position {session.position}, not at "
                                  f"{position} where its peer's part is")

    async def hand_over(self, session: Session, peer_id: str, addrs: list[str]) -> None:
        """Replay mode: once no step of `session` runs, frees it here and sends its client to `peer_id`, where the
        client replays the inputs it kept (the KV is recomputed there: no bytes cross between the servers)."""
        if session.moving is not None or session.importing_from is not None:
            raise SessionNotFound(f"session {session.session_id!r} is already moving")
        moving = session.moving = asyncio.get_running_loop().create_future()
        try:
            await self.quiesce(session)
        except BaseException:
            self.stats.failed_out += 1
            session.moving = None
            moving.set_result(None)  # its waiting steps go on here
            raise
        session.moving = None
        self._remember(session.session_id, peer_id, addrs, "replay")
        self.sessions.close(session.session_id)
        moving.set_result(None)
        self.stats.sessions_out["replay"] += 1
        log.info("Handed session %s (%d tokens) over to %s for a replay", session.session_id, session.position,
                 peer_id)

    async def quiesce(self, session: Session) -> None:
        """Waits until no step of `session` runs and no batch holds its pages."""
        deadline = time.monotonic() + STEP_WAIT_S
        while session.running is not None or session.in_batches:
            if time.monotonic() > deadline:
                raise SessionNotFound(f"session {session.session_id!r} kept computing for {STEP_WAIT_S:.0f} s")
            await asyncio.sleep(POLL_S)
        if not self.sessions.is_open(session):
            raise SessionNotFound(f"session {session.session_id!r} closed before it could move")

    def block_token_bytes(self) -> int:
        """Gives the KV bytes of one token of one row in one block."""
        return kv_bytes_per_token(kv_heads=self.kv.kv_heads, head_dim=self.kv.head_dim, dtype=self.dtype)

    def _frames(self, session: Session, first: int, last: int) -> list[list[tuple[int, int, int, int]]]:
        """Gives the session's filled KV of blocks [first, last) in the pieces one `import_kv` frame each carries:
        (block, row, start, end)
        token ranges, at most `chunk_bytes` of keys and values a frame (a piece of one token at least), several
        blocks' and rows' pieces sharing a frame."""
        token_bytes = self.block_token_bytes()
        span = max(1, self.chunk_bytes // token_bytes)
        frames: list[list[tuple[int, int, int, int]]] = [[]]
        room = span
        for block in range(first, last):
            for row in range(session.batch):
                start = 0
                while start < session.position:
                    if room == 0:
                        frames.append([])
                        room = span
                    end = min(session.position, start + room)
                    frames[-1].append((block, row, start, end))
                    room -= end - start
                    start = end
        return [frame for frame in frames if frame]

    def _piece(self, session: Session, block: int, row: int, start: int, end: int) -> dict[str, Any]:
        return {"block": block, **kv_piece(self.kv, session.page_tables[block][row], row, start, end)}

    @staticmethod
    async def _abort_remote(destination: RpcConnection, session_id: str) -> None:
        try:
            await destination.call("import_abort", {"session_id": session_id}, timeout=PEER_CALL_TIMEOUT_S)
        except SwarmError as error:  # it drops the import by itself once it stays idle
            log.debug("could not abort the import of %s on %s: %s", session_id, destination.peer_id, error.message)

    def _remember(self, session_id: str, peer_id: str, addrs: list[str], mode: Mode, hops: list[Hop] | None = None,
                  position: int = 0) -> None:
        now = time.monotonic()
        self._moved = {sid: entry for sid, entry in self._moved.items() if now - entry.when < MOVED_TTL_S}
        while len(self._moved) >= MAX_MOVED:
            self._moved.pop(next(iter(self._moved)))
        self._moved[session_id] = _Departure(peer_id, list(addrs), mode, now, list(hops or []), position)
        self.unclaimed = {sid for sid in self.unclaimed if sid in self._moved} | {session_id}

    def untold_departure(self, session_id: str) -> tuple[str, list[str]] | None:
        """Gives the server (peer id, addresses) that `session_id`'s KV moved to, whole, if its client has not yet
        been told so (and forgets that it was not): its client closing it here closes it there."""
        moved = self._moved.get(session_id)
        if moved is None or moved.mode != "kv" or moved.hops or session_id not in self.unclaimed:
            return None
        if self._find(session_id) is not None:
            return None
        self.unclaimed.discard(session_id)
        return moved.peer_id, list(moved.addrs)

    def note_replayed_in(self, session_id: str) -> None:
        """Counts a session that arrived by replay (its client opened it here, naming the server it came from, under
        its id there); if it had left this server before, it is back."""
        self.stats.sessions_in["replay"] += 1
        self._moved.pop(session_id, None)
        self.unclaimed.discard(session_id)

    # ---- the destination

    def open_import(
        self, source: str, session_id: str, start: int, end: int, *, batch: int, max_length: int, position: int,
        client: str, lease_id: str | None = None, merge: bool = False, kv_elsewhere: bool = False,
    ) -> Session:
        """Opens `session_id` with pages for its `position` tokens, importing from `source`; `client`, the peer
        that opened the session where it came from, may move it on from here; `lease_id`, the orchestrator's lease
        it runs under, goes with it. With `merge`, the blocks join this server's open session `session_id`, which
        they must adjoin, at its position. With `kv_elsewhere` it opens with no pages, its KV still on `source`
        (KunServe's live exchange: the copy takes them block by block)."""
        if position < 0:
            raise InvalidTensor(f"a session's position is at least 0, got {position}")
        if merge:
            return self._open_merge(source, session_id, start, end, batch=batch, position=position)
        session = self.sessions.open(session_id, start, end, batch=batch, max_length=max_length, opener=client,
                                     tokens=max(1, position), moved_in=True, kv_elsewhere=kv_elsewhere)
        session.importing_from, session.lease_id = source, lease_id
        self._moved.pop(session_id, None)
        return session

    def _open_merge(self, source: str, session_id: str, start: int, end: int, *, batch: int,
                    position: int) -> Session:
        session = self.sessions.get(session_id)
        if session.importing_from is not None or session.merging is not None:
            raise SessionNotFound(f"session {session_id!r} is already taking KV from a peer")
        if not (end == session.start or start == session.end) or batch != session.batch:
            raise InvalidTensor(f"blocks {start}:{end} x {batch} rows do not adjoin session {session_id!r} "
                                f"({session.start}:{session.end} x {session.batch} rows)")
        if position != session.position:
            raise SessionNotFound(f"session {session_id!r} is at position {session.position}, not at {position}")
        self.sessions.check_hosted(start, end)
        self.sessions.take_blocks(session, start, end, max(1, position))
        session.merging = (source, start, end)
        session.last_active_s = time.monotonic()
        return session

    def write_kv(self, source: str, session_id: str, block: int, row: int, start: int, keys: Any,
                 values: Any) -> int:
        """Writes one chunk of an import; gives its bytes."""
        session, (first, last) = self._import(source, session_id)
        if not (first <= block < last and 0 <= row < session.batch):
            raise InvalidTensor(f"block {block} row {row} is outside the import ({first}:{last})")
        pages = session.page_tables[block][row]
        k, v = decode_kv(self.kv, keys, values, max_tokens=session.max_length)
        tokens = k.shape[1]
        if not (start >= 0 and start + tokens <= len(pages) * self.kv.tokens_per_page):
            raise InvalidTensor(f"tokens {start}:{start + tokens} lie outside the pages the import took")
        self.kv.write(pages, start, k.transpose(0, 1), v.transpose(0, 1))
        session.last_active_s = time.monotonic()
        chunk_bytes = tokens * self.block_token_bytes()
        self.stats.bytes_in += chunk_bytes
        return chunk_bytes

    def commit(self, source: str, session_id: str, position: int, last_step_id: str | None,
               last_output: Any | None) -> Session:
        """Makes an import a session of this server at `position` (a merge: part of its session). An import of
        blocks this server stopped hosting meanwhile (a drop while a restore's merge ran) is dropped and raises
        BlocksNotHosted: the source keeps the session, and a merge's session stays as it was."""
        session, (first, last) = self._import(source, session_id)
        try:
            self.sessions.check_hosted(first, last)
        except BlocksNotHosted:
            self.abort(source, session_id)
            raise
        held = kv_tokens_held(session, self.kv.tokens_per_page, first, last)
        if not 0 <= position <= held:
            raise InvalidTensor(f"position {position} is outside the {held} tokens the import holds")
        if session.merging is not None:
            if position != session.position:
                raise SessionNotFound(f"session {session_id!r} is at position {session.position}, the merge at "
                                      f"{position}")
            session.start, session.end = min(session.start, first), max(session.end, last)
            session.merging = None
            session.hops = [Hop(self.peer_id, session.start, session.end, session_id)]
            # Its output now ends at the part's last block: the part's output of the step both ran is the merged
            # session's (a pushed step ran through both before the merge; its client asks for it again by its id).
            ran_both = last_step_id is not None and last_step_id == session.last_step_id and last_output is not None
            session.last_result = self._last_result(session, last_output) if ran_both else None
            session.last_step_id = last_step_id if ran_both else None
            session.last_active_s = time.monotonic()
            self.stats.sessions_in["kv"] += 1
            return session
        if last_step_id is not None and last_output is not None:
            session.last_step_id, session.last_result = last_step_id, self._last_result(session, last_output)
        session.position = position
        session.importing_from = None
        session.last_active_s = time.monotonic()
        self.stats.sessions_in["kv"] += 1
        return session

    def _last_result(self, session: Session, last_output: Any) -> StepResult:
        """Gives the result of the last step the source's part of `session` ran, from its output on the wire."""
        output = decode_tensor(last_output, max_elements=session.batch * session.max_length * self.hidden_size)
        return StepResult(output, 0.0, 0)

    def abort(self, source: str, session_id: str) -> None:
        """Drops an import (its pages return to the pool; a merge's session stays as it was)."""
        session, (first, last) = self._import(source, session_id)
        if session.merging is not None:
            self.sessions.release_blocks(session, first, last)
            session.merging = None
            return
        self.sessions.close(session_id)

    def expire_imports(self) -> list[str]:
        """Drops the imports that received nothing for `import_idle_s`; gives their ids."""
        now = time.monotonic()
        stale = [s for s in self.sessions if (s.importing_from is not None or s.merging is not None)
                 and now - s.last_active_s > self.import_idle_s]
        for session in stale:
            source = session.importing_from or (session.merging[0] if session.merging else "")
            self.abort(source, session.session_id)
        return [session.session_id for session in stale]

    def _import(self, source: str, session_id: str) -> tuple[Session, tuple[int, int]]:
        """Gives the session `source` imports into and the blocks it imports."""
        session = self._find(session_id)
        if session is not None and session.merging is not None:
            merging_from, first, last = session.merging
            if merging_from != source:
                raise SessionNotFound(f"session {session_id!r} is taking KV from another server than {source}")
            return session, (first, last)
        if session is None or session.importing_from is None:
            raise SessionNotFound(f"no import of session {session_id!r} is in progress here")
        if session.importing_from != source:
            raise SessionNotFound(f"session {session_id!r} is being imported from another server than {source}")
        return session, (session.start, session.end)

    def _find(self, session_id: str) -> Session | None:
        try:
            return self.sessions.get(session_id)
        except SwarmError:  # not open (unknown, closed or evicted)
            return None


def kv_piece(kv: PagedKV, pages: list[int], row: int, start: int, end: int) -> dict[str, Any]:
    """Gives the wire map of tokens [start, end) of one row's KV pages in one block: `{row, start, keys,
    values}`, keys and values `[kv_heads, tokens, head_dim]` each."""
    keys, values = kv.read(pages, start, end)
    return {"row": row, "start": start, "keys": encode_tensor(keys.contiguous()),
            "values": encode_tensor(values.contiguous())}


def decode_kv(kv: PagedKV, keys: Any, values: Any, *, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives the keys and values of a KV piece (`kv_piece`) in the pages' dtype, `[kv_heads, tokens, head_dim]`
    each with 1 <= tokens <= `max_tokens`; raises InvalidTensor for anything else."""
    max_elements = kv.kv_heads * max_tokens * kv.head_dim
    k = decode_tensor(keys, max_elements=max_elements)
    v = decode_tensor(values, max_elements=max_elements)
    tokens = k.shape[1] if k.dim() == 3 else -1
    if k.shape != v.shape or tokens < 1 or (k.shape[0], k.shape[2]) != (kv.kv_heads, kv.head_dim):
        raise InvalidTensor(f"KV chunk of shape {list(k.shape)} / {list(v.shape)}, expected "
                            f"[{kv.kv_heads}, tokens, {kv.head_dim}] for both")
    return k.to(kv.dtype), v.to(kv.dtype)


def kv_tokens_held(session: Session, tokens_per_page: int, first: int, last: int) -> int:
    """Gives the tokens every row of blocks [first, last) of `session` has pages for."""
    rows = [pages for block in range(first, last) for pages in session.page_tables.get(block, [[]])]
    return min((len(pages) for pages in rows), default=0) * tokens_per_page
