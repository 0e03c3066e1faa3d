"""KunServe's live exchange (Sec. 4.2, spec 3.5): a drop's victim goes on at once through the server that keeps its
dropped blocks, while its KV for them is still here; that server has this one attend for those blocks until the KV
has followed.

Attention needs a block's KV but none of its weights; every other part of a block needs its weights but no KV. So
after a drop, for a victim `S` whose blocks [a, b) this server (the lender) dropped:
1. the lender asks the keeper, a server that keeps [a, b), to open `S` over [a, b) at its position (`attend_open`);
   the keeper takes no pages for it yet, so a keeper whose pool is full takes the victim all the same; the lender's
   part of `S` shrinks to the blocks it keeps, and its pages for [a, b) stay here, lent to the keeper (owned by
   `KVOwner(S, block, lent=True)`): the next step of `S` learns the new chain (`ChainChanged`), no replay;
2. the keeper computes each step of `S` itself, one block after another: where a block's KV is still lent, it
   projects the queries, keys and values with its weights and sends them to the lender (`attend`), which appends the
   keys and values to the lent pages and answers the attention output; the keeper finishes the block with its weights;
3. meanwhile the keeper copies each lent block's KV (`attend_read`, on a stream of its own, so that bulk never
   delays a step's attention by more than one chunk), taking the block's pages chunk by chunk as free pages allow
   (its steps attend on the lender while none are); once what is left is at most `TAIL_TOKENS`, and the keeper has
   the pages for the rest, the next step's `attend` for that block also brings the tokens since the copy (the final
   catch-up), the block's KV is the keeper's from then on and the lender frees its lent pages. When no block is lent
   any more, `S` joins the keeper's batches again.
   [chainswarm: until stop 45 the keeper took the victim's pages for every lent block at `attend_open`. Two buddies
   whose pools were full then waited on each other: each one's dropped blocks stay loaded until its own victims are
   lent, and lending needed room on the other. After 2 s the exchange evicted the victims for a replay.]
A lender forgets lent KV whose keeper went silent for `import_idle_s`, or that the keeper gave up (`attend_release`);
a keeper whose lender is lost fails the step with `SessionNotFound`: the client replays that part of the chain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from hivemind.p2p import P2P

from server.config import ServerConfig
from server.migration import Migrations, close_remote, decode_kv, kv_piece
from server.sessions import Session, SessionTable, Step, StepResult
from swarm.errors import Hop, InvalidTensor, MigrationRefused, PeerUnreachable, SessionNotFound, SwarmError
from swarm.memory import KVOwner, PagePool, kv_pages_for
from swarm.model import BlockRange
from swarm.model.decoder import attend_chunk
from swarm.model.paged_kv import PagedBatch, PagedKV, SequenceChunk
from swarm.records import ServerRecord
from swarm.rpc import CallContext, RpcConnection, dial
from swarm.wire import decode_tensor, encode_tensor
from swarm.wire import field as payload_field

log = logging.getLogger(__name__)

TAIL_TOKENS = 64  # a lent block switches to its keeper at a step once at most this many tokens are left to copy
POLL_S = 0.02  # how often the copier looks whether a block it caught up with has switched
MAX_ADDRS = 16


@dataclass
class LentBlock:
    """One block of a session whose KV this server lends to `keeper`: its pages by row and its tokens so far."""

    session_id: str
    block: int
    keeper: str
    rows: list[list[int]]
    length: int
    last_active_s: float = field(default_factory=time.monotonic)


@dataclass
class RemoteKV:
    """On a keeper: where the KV of a session's blocks still lent lies, and how far each one's copy got."""

    lender: str
    addrs: list[str]
    copied: dict[int, int]  # lent block -> tokens copied here so far
    steps: RpcConnection | None = None  # the stream for the steps' `attend` calls
    bulk: RpcConnection | None = None  # the stream for the copy

    @property
    def lent(self) -> list[int]:
        return sorted(self.copied)


@dataclass
class LiveStats:
    """What remote attention did on this server, as lender and as keeper."""

    lent_sessions: int = 0  # victims this server lent the KV of
    lent_blocks_open: int = 0
    kept_sessions: int = 0  # victims that went on here while their KV was lent
    attends_served: int = 0
    attends_sent: int = 0
    attend_ms_total: float = 0.0  # the keeper's round trips for `attend`
    switched_blocks: int = 0  # lent blocks whose KV became the keeper's
    copied_bytes: int = 0
    lost: int = 0  # sessions whose lender was lost before their KV followed

    def to_wire(self) -> dict[str, Any]:
        return {"lent_sessions": self.lent_sessions, "lent_blocks_open": self.lent_blocks_open,
                "kept_sessions": self.kept_sessions, "attends_served": self.attends_served,
                "attends_sent": self.attends_sent,
                "attend_ms_mean": round(self.attend_ms_total / self.attends_sent, 3) if self.attends_sent else 0.0,
                "switched_blocks": self.switched_blocks, "copied_bytes": self.copied_bytes, "lost": self.lost}


class AttentionHost(Protocol):
    """What remote attention needs of its server (`server.server.SwarmServer`)."""

    config: ServerConfig
    blocks: BlockRange
    kv: PagedKV
    pool: PagePool
    sessions: SessionTable
    migrations: Migrations
    p2p: P2P | None
    dtype: torch.dtype

    @property
    def peer_id(self) -> str: ...

    def record(self) -> ServerRecord: ...


class RemoteAttention:
    """Both ends of the live exchange on one server: lending a victim's KV, and computing steps over lent KV."""

    def __init__(self, server: AttentionHost) -> None:
        self.server = server
        self.stats = LiveStats()
        self._lent: dict[tuple[str, int], LentBlock] = {}
        self._copiers: dict[str, asyncio.Task[None]] = {}

    # ---- the lender

    async def lend(self, session: Session, keeper: str, addrs: list[str], start: int, end: int,
                   hops: list[Hop]) -> None:
        """Hands blocks [start, end) of `session` (a prefix or suffix) to `keeper`, whose weights compute them from
        now on, and lends it their KV until it has copied it; `hops` is the chain the session runs on then."""
        server = self.server
        if not (session.start <= start < end <= session.end and (start == session.start or end == session.end)):
            raise InvalidTensor(f"blocks {start}:{end} are not a prefix or suffix of the session's "
                                f"{session.start}:{session.end}")
        if session.moving is not None or session.importing_from is not None or session.remote is not None:
            raise MigrationRefused(f"session {session.session_id!r} is moving already")
        assert server.p2p is not None
        try:
            connection = await dial(server.p2p, keeper, addrs, timeout=server.config.push_timeout_s,
                                    max_frame_bytes=server.config.max_frame_bytes)
        except PeerUnreachable as error:
            raise PeerUnreachable(error.message, {"peer_id": keeper}) from None
        moving = session.moving = asyncio.get_running_loop().create_future()  # its steps wait for the hand-over
        try:
            await server.migrations.quiesce(session)
            request: dict[str, Any] = {
                "session_id": session.session_id, "blocks": [start, end], "batch": session.batch,
                "max_length": session.max_length, "position": session.position, "client": session.opener,
                "addrs": server.record().addrs[:MAX_ADDRS],
                **({"lease_id": session.lease_id} if session.lease_id else {}),
            }
            if end == session.end and session.last_step_id is not None and session.last_result is not None:
                request["last_step_id"] = session.last_step_id  # a step repeated to the keeper is answered there
                request["last_output"] = encode_tensor(session.last_result.output)
            self._check_open(session)
            lent = [LentBlock(session.session_id, block, keeper, session.page_tables[block], session.position)
                    for block in range(start, end)]
            for block in range(start, end):  # lent from here on, so that a close meanwhile leaves them to the keeper
                server.pool.reown(KVOwner(session.session_id, block), KVOwner(session.session_id, block, lent=True))
            self._lent.update({(session.session_id, block.block): block for block in lent})  # the keeper may read
            try:  # at once
                await connection.call("attend_open", request, timeout=server.config.push_timeout_s)
            except BaseException:
                self._take_back(session, lent)
                raise
            if not server.sessions.is_open(session):  # its client closed it meanwhile (r70, r71): what the keeper
                self._take_back(session, lent)  # opened would hold pages no client ever steps or closes
                await close_remote(connection, session.session_id)
                raise SessionNotFound(f"session {session.session_id!r} closed while it was being lent")
            for block in range(start, end):
                session.page_tables.pop(block)
            server.sessions.release_blocks(session, start, end)  # its pages are lent now: nothing left to free
            session.untold.append((keeper, list(addrs)))
            session.hops = hops
            session.last_step_id, session.last_result = None, None  # its output now ends elsewhere
        finally:
            session.moving = None
            moving.set_result(None)
            await connection.close()
        self.stats.lent_sessions += 1
        self.stats.lent_blocks_open = len(self._lent)
        log.info("Lent session %s's KV of blocks %d:%d (%d tokens) to %s, which attends through it", session.session_id,
                 start, end, session.position, keeper)

    def _check_open(self, session: Session) -> None:
        if not self.server.sessions.is_open(session):
            raise SessionNotFound(f"session {session.session_id!r} closed while it was being lent")

    def _take_back(self, session: Session, lent: list[LentBlock]) -> None:
        """Undoes the lending of `lent` that did not complete: their pages go back to `session`, or to the pool if
        it closed meanwhile."""
        still_open = self.server.sessions.is_open(session)
        for block in lent:
            self._lent.pop((block.session_id, block.block), None)
            owner = KVOwner(block.session_id, block.block, lent=True)
            if still_open:
                self.server.pool.reown(owner, KVOwner(block.session_id, block.block))
            else:
                self.server.pool.free(owner)
        self.stats.lent_blocks_open = len(self._lent)

    async def attend(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """RPC: appends a keeper's new keys and values to a lent block and answers their queries' attention output
        (`attended`); with `tail_from`, also the block's KV since that token (`tail`), after which it is the keeper's
        and its lent pages are freed here."""
        server = self.server
        lent = self._lent_block(payload, ctx)
        position, tokens = payload_field(payload, "position", int), payload_field(payload, "tokens", int)
        rows = len(lent.rows)
        shape = server.blocks.attention_shape(lent.block)
        if not (0 <= position <= lent.length and 1 <= tokens and position + tokens <= server.config.max_length):
            raise InvalidTensor(f"tokens {position}:{position + tokens} do not follow the {lent.length} tokens lent "
                                f"for block {lent.block}")
        limit = rows * tokens * shape.heads * shape.head_dim
        queries = decode_tensor(payload.get("queries"), dtype=server.dtype, max_elements=limit)
        keys = decode_tensor(payload.get("keys"), dtype=server.dtype, max_elements=limit)
        values = decode_tensor(payload.get("values"), dtype=server.dtype, max_elements=limit)
        if (queries.shape != (rows * tokens, shape.heads, shape.head_dim)
                or keys.shape != (rows * tokens, shape.kv_heads, shape.head_dim) or values.shape != keys.shape):
            raise InvalidTensor(f"attend needs queries [{rows * tokens}, {shape.heads}, {shape.head_dim}] and keys and "
                                f"values [{rows * tokens}, {shape.kv_heads}, {shape.head_dim}], got "
                                f"{list(queries.shape)}, {list(keys.shape)}, {list(values.shape)}")
        tail_from = payload_field(payload, "tail_from", int, optional=True)
        if tail_from is not None and not 0 <= tail_from <= position:
            raise InvalidTensor(f"tail_from {tail_from} is outside 0..{position}")
        self._grow(lent, position + tokens)
        attended = _attend_rows(queries, keys, values, lent, position, tokens, server.kv, shape)
        lent.length, lent.last_active_s = position + tokens, time.monotonic()
        self.stats.attends_served += 1
        reply: dict[str, Any] = {"attended": encode_tensor(attended)}
        if tail_from is not None:
            reply["tail"] = self._pieces(lent, tail_from, lent.length)
            self._free(lent)
        return reply

    async def read(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """RPC: answers the KV of a lent block's tokens [start, end) (`pieces`, one per row), for its keeper's copy."""
        lent = self._lent_block(payload, ctx)
        start, end = payload_field(payload, "start", int), payload_field(payload, "end", int)
        if not 0 <= start < end <= lent.length:
            raise InvalidTensor(f"tokens {start}:{end} are outside the {lent.length} tokens lent for {lent.block}")
        lent.last_active_s = time.monotonic()
        return {"pieces": self._pieces(lent, start, end), "length": lent.length}

    async def release(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """RPC: frees what this server lends the caller of a session (the keeper closed it or gave it up)."""
        session_id = payload_field(payload, "session_id", str)
        mine = [lent for lent in self._lent.values() if lent.session_id == session_id and lent.keeper == ctx.peer_id]
        for lent in mine:
            self._free(lent)
        return {"freed_blocks": len(mine)}

    def expire(self) -> int:
        """Frees the lent KV whose keeper went silent for `import_idle_s`; gives how many blocks."""
        now = time.monotonic()
        stale = [lent for lent in self._lent.values()
                 if now - lent.last_active_s > self.server.migrations.import_idle_s]
        for lent in stale:
            self._free(lent)
        return len(stale)

    def _lent_block(self, payload: dict[str, Any], ctx: CallContext) -> LentBlock:
        session_id = payload_field(payload, "session_id", str)
        block = payload_field(payload, "block", int)
        lent = self._lent.get((session_id, block))
        if lent is None or lent.keeper != ctx.peer_id:
            raise SessionNotFound(f"this server lends no KV of block {block} of session {session_id!r} to "
                                  f"{ctx.peer_id}")
        return lent

    def _grow(self, lent: LentBlock, tokens: int) -> None:
        needed = kv_pages_for(tokens, self.server.kv.tokens_per_page)
        missing = max(0, needed - len(lent.rows[0]))
        if missing == 0:
            return
        taken = list(self.server.pool.take(KVOwner(lent.session_id, lent.block, lent=True), missing * len(lent.rows)))
        for row, pages in enumerate(lent.rows):
            pages.extend(taken[row * missing:(row + 1) * missing])

    def _pieces(self, lent: LentBlock, start: int, end: int) -> list[dict[str, Any]]:
        if start == end:
            return []
        return [kv_piece(self.server.kv, pages, row, start, end) for row, pages in enumerate(lent.rows)]

    def _free(self, lent: LentBlock) -> None:
        if self._lent.pop((lent.session_id, lent.block), None) is not None:
            self.server.pool.free(KVOwner(lent.session_id, lent.block, lent=True))
        self.stats.lent_blocks_open = len(self._lent)

    # ---- the keeper

    async def open(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """RPC: opens the lender's victim here over the blocks it dropped, at its position, its KV still lent."""
        server = self.server
        session_id = payload_field(payload, "session_id", str)
        blocks = payload_field(payload, "blocks", list)
        client = payload_field(payload, "client", str, optional=True) or ctx.peer_id
        lease_id = payload_field(payload, "lease_id", str, optional=True)
        if len(session_id) > 128 or len(client) > 128 or len(lease_id or "") > 128:
            raise InvalidTensor("session_id, client or lease_id is longer than 128 characters")
        if len(blocks) != 2 or not all(isinstance(block, int) for block in blocks):
            raise InvalidTensor(f"blocks must be [start, end], got {blocks!r:.80}")
        position = payload_field(payload, "position", int)
        addrs = payload_field(payload, "addrs", list, optional=True) or []
        if len(addrs) > MAX_ADDRS or not all(isinstance(addr, str) and len(addr) <= 512 for addr in addrs):
            raise InvalidTensor(f"addrs must be at most {MAX_ADDRS} addresses")
        session = server.migrations.open_import(
            ctx.peer_id, session_id, blocks[0], blocks[1], batch=payload_field(payload, "batch", int),
            max_length=payload_field(payload, "max_length", int), position=position, client=client,
            lease_id=lease_id, kv_elsewhere=True,
        )
        session.importing_from, session.position = None, position
        session.remote = RemoteKV(ctx.peer_id, addrs, {block: 0 for block in range(session.start, session.end)})
        last_step_id = payload_field(payload, "last_step_id", str, optional=True)
        if last_step_id is not None and payload.get("last_output") is not None:
            output = decode_tensor(payload["last_output"], dtype=server.dtype,
                                   max_elements=session.batch * session.max_length * server.blocks.hidden_size)
            session.last_step_id, session.last_result = last_step_id, StepResult(output, 0.0, 0)
        self.stats.kept_sessions += 1
        self._copiers[session_id] = asyncio.create_task(self._copy(session), name=f"copy-lent-{session_id[:16]}")
        self._copiers[session_id].add_done_callback(lambda _: self._copiers.pop(session_id, None))
        return {}

    async def forward(self, step: Step) -> torch.Tensor:
        """Gives the output rows of `step` of a session some of whose KV is still lent: block by block, attention
        by the lender where the block's KV is still there."""
        server, session = self.server, step.session
        remote = session.remote
        assert remote is not None
        tokens, rows = step.tokens, step.rows
        hidden = step.hidden.reshape(rows * tokens, -1).to(server.blocks.device, server.dtype)
        batch = PagedBatch(tuple(session.chunks(0, 0, tokens)))
        cos, sin = server.blocks.rotary.lookup(batch.positions())
        for index in range(session.start, session.end):
            block = server.blocks.block(index)
            if index not in remote.copied:
                hidden = _run_block(block, hidden, batch, server.kv, index, cos, sin)
                continue
            queries, keys, values = _project(block, hidden, cos, sin)
            attended = await self._attend_remote(session, remote, index, queries, keys, values, tokens)
            hidden = _finish(block, hidden, attended)
        if not remote.copied:
            await self._settle(session, remote)
        return hidden

    async def _attend_remote(self, session: Session, remote: RemoteKV, block: int, queries: torch.Tensor,
                             keys: torch.Tensor, values: torch.Tensor, tokens: int) -> torch.Tensor:
        server = self.server
        copied = remote.copied[block]
        # the rest comes with this call, and the block is ours, once it is that close and it has the pages for it here
        switching = (session.position - copied <= TAIL_TOKENS
                     and server.sessions.grow_block(session, block, session.position + tokens))
        request: dict[str, Any] = {
            "session_id": session.session_id, "block": block, "position": session.position, "tokens": tokens,
            "queries": encode_tensor(queries.contiguous()), "keys": encode_tensor(keys.contiguous()),
            "values": encode_tensor(values.contiguous()), **({"tail_from": copied} if switching else {}),
        }
        started = time.perf_counter()
        try:
            if remote.steps is None or remote.steps.is_closed:
                remote.steps = await self._dial(remote)
            reply = await remote.steps.call("attend", request, timeout=server.config.push_timeout_s)
        except SwarmError as error:
            self.stats.lost += 1
            raise SessionNotFound(f"the KV of block {block} of session {session.session_id!r} is on {remote.lender}, "
                                  f"which did not attend ({type(error).__name__}: {error.message})") from None
        self.stats.attends_sent += 1
        self.stats.attend_ms_total += (time.perf_counter() - started) * 1000
        attended = decode_tensor(reply.get("attended"), dtype=server.dtype, max_elements=queries.numel())
        if attended.shape != (queries.shape[0], queries.shape[1] * queries.shape[2]):
            raise InvalidTensor(f"the lender's attention output has shape {list(attended.shape)}")
        if switching:
            self._write(session, block, reply.get("tail"), copied, session.position + tokens)
            del remote.copied[block]
            self.stats.switched_blocks += 1
        return attended

    async def _copy(self, session: Session) -> None:
        """Copies the lent blocks' KV here, block by block, until each is within TAIL_TOKENS of the session (its next
        step's `attend` brings the rest); gives up what is lent once the session closed."""
        server, remote = self.server, session.remote
        assert remote is not None
        span = max(1, server.migrations.chunk_bytes // (server.migrations.block_token_bytes() * session.batch))
        try:
            remote.bulk = await self._dial(remote)
            while remote.copied and server.sessions.is_open(session):
                block = next((b for b in remote.lent if session.position - remote.copied[b] > TAIL_TOKENS), None)
                if block is None:
                    await asyncio.sleep(POLL_S)  # each lent block waits for a step to switch it
                    continue
                start = remote.copied[block]
                end = min(session.position, start + span)
                if not server.sessions.grow_block(session, block, end):
                    await asyncio.sleep(POLL_S)  # no room here yet: its steps attend on the lender meanwhile
                    continue
                reply = await remote.bulk.call("attend_read", {"session_id": session.session_id, "block": block,
                                                               "start": start, "end": end},
                                               timeout=server.config.push_timeout_s)
                if block in remote.copied and server.sessions.is_open(session):
                    self._write(session, block, reply.get("pieces"), start, end)
                    remote.copied[block] = end
        except SwarmError as error:
            log.info("Copying session %s's lent KV from %s stopped (%s: %s); its steps still attend there",
                     session.session_id, remote.lender, type(error).__name__, error.message)
        except Exception:  # a bug must not pass silently; the session's steps still attend on the lender
            log.exception("copying session %s's lent KV failed", session.session_id)
        finally:
            if remote.copied and not server.sessions.is_open(session):
                await self._give_up(session, remote)
            if remote.bulk is not None:
                await remote.bulk.close()

    def _write(self, session: Session, block: int, pieces: object, start: int, end: int) -> None:
        """Writes the lender's KV of tokens [start, end) of `block` (one piece per row) into the session's pages."""
        server = self.server
        if not isinstance(pieces, list) or len(pieces) != (session.batch if end > start else 0):
            raise InvalidTensor(f"expected {session.batch} rows of KV for block {block}, got {pieces!r:.80}")
        for piece in pieces:
            if not isinstance(piece, dict):
                raise InvalidTensor(f"a piece of KV is not a map: {piece!r:.80}")
            row = payload_field(piece, "row", int)
            keys, values = decode_kv(server.kv, piece.get("keys"), piece.get("values"), max_tokens=end - start)
            if not 0 <= row < session.batch or keys.shape[1] != end - start:
                raise InvalidTensor(f"KV piece of row {row} has {keys.shape[1]} tokens, expected {end - start}")
            server.kv.write(session.page_tables[block][row], start, keys.transpose(0, 1), values.transpose(0, 1))
            self.stats.copied_bytes += (end - start) * server.migrations.block_token_bytes()

    async def _settle(self, session: Session, remote: RemoteKV) -> None:
        """Ends the live exchange of a session whose KV is all here: it computes in batches from its next step."""
        session.remote = None
        if remote.steps is not None:
            await remote.steps.close()
        log.info("Session %s's KV from %s is all here now", session.session_id, remote.lender)

    async def _give_up(self, session: Session, remote: RemoteKV) -> None:
        try:
            connection = remote.steps if remote.steps is not None and not remote.steps.is_closed else None
            connection = connection or await self._dial(remote)
            await connection.call("attend_release", {"session_id": session.session_id},
                                  timeout=self.server.config.push_timeout_s)
            await connection.close()
        except SwarmError as error:  # the lender frees it by itself once it stays idle
            log.debug("could not release session %s's KV on %s: %s", session.session_id, remote.lender, error.message)

    async def _dial(self, remote: RemoteKV) -> RpcConnection:
        server = self.server
        assert server.p2p is not None
        return await dial(server.p2p, remote.lender, remote.addrs, timeout=server.config.push_timeout_s,
                          max_frame_bytes=server.config.max_frame_bytes)

    async def stop(self) -> None:
        """Stops the copies; frees what this server lends."""
        for task in list(self._copiers.values()):
            task.cancel()
        await asyncio.gather(*self._copiers.values(), return_exceptions=True)
        for lent in list(self._lent.values()):
            self._free(lent)


@torch.inference_mode()
def _run_block(block: Any, hidden: torch.Tensor, batch: PagedBatch, kv: PagedKV, index: int, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    return block(hidden, batch, kv, index, cos, sin)


@torch.inference_mode()
def _project(block: Any, hidden: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return block.project(hidden, cos, sin)


@torch.inference_mode()
def _finish(block: Any, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    return block.finish(hidden, attended)


@torch.inference_mode()
def _attend_rows(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lent: LentBlock, position: int,
                 tokens: int, kv: PagedKV, shape: Any) -> torch.Tensor:
    """Gives the attention output of each row's `tokens` queries over the lent block's history and their own keys."""
    output = queries.new_empty(queries.shape[0], shape.heads * shape.head_dim)
    for row, pages in enumerate(lent.rows):
        chunk = SequenceChunk(row * tokens, tokens, position, lent.block, lent.block + 1, {lent.block: pages})
        output[chunk.rows] = attend_chunk(queries[chunk.rows], keys[chunk.rows], values[chunk.rows], chunk, kv,
                                          lent.block, shape)
    return output
