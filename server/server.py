"""A swarm server: hosts a block range, announces it on the DHT, and serves inference sessions over RPC."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import hivemind
import torch
from hivemind.p2p import P2P

from orchestrator.admission import ClientQuota
from orchestrator.block_selection import HostedSpan, better_start, blocks_that_fit, choose_start
from orchestrator.live_model import replay_prefill_ms_per_token
from orchestrator.packing import choose_mode
from orchestrator.packing.migration_split import MigrationCosts, move_costs
from server import allocator
from server.batch_trace import BatchTrace
from server.compute import DECODE_BATCHES, PREFILL_CHUNK_TOKENS, BlockSpeed, cached_block_speed
from server.config import ServerConfig
from server.drop_member import DropMember, opened_digests, refused_digests
from server.emulated_gpu import load_profile
from server.exchange import EXCHANGE_STUCK_S, BlockExchange
from server.hosting import Hosting
from server.metrics import ServerMetrics
from server.migration import (
    AUTO,
    MAX_PIECES_PER_FRAME,
    MODES,
    PEER_CALL_TIMEOUT_S,
    Migrations,
    MoveChoice,
    close_remote,
)
from server.packing_member import PackingMember
from server.push import Pusher
from server.remote_attention import RemoteAttention
from server.scheduler import DEFAULT_MAX_BATCH_TOKENS, StepScheduler
from server.sessions import Session, SessionTable, Step, StepResult
from swarm.dht import Announcer, lookup_block_async, lookup_servers_async
from swarm.errors import (
    AssignmentRefused,
    InternalServerError,
    InvalidTensor,
    MalformedFrame,
    MaxLengthExceeded,
    MigrationRefused,
    OutOfPages,
    PeerUnreachable,
    PositionMismatch,
    ServerBusy,
    ServerDraining,
    StepNotPushed,
    StepStopped,
    SwarmError,
)
from swarm.memory import PagePool, ParamsOwner, default_budget_bytes, parse_size
from swarm.metrics import serve_metrics
from swarm.model import BlockRange, ModelSource, parse_block_range, pick_device, pick_dtype, resolve_model
from swarm.records import SOFTWARE_VERSION, BatchTiming, NextHop, ServerRecord, ServerState
from swarm.rpc import CallContext, RpcConnection, RpcServer, dial
from swarm.signing import open_dht
from swarm.wire import MAX_STEPS_PER_FRAME, decode_tensor, encode_tensor, field, validate_compression

log = logging.getLogger(__name__)

_THROUGHPUT_MIN_BYTES = 64 << 10  # smaller frames measure latency, not bandwidth
SELF_CHOSEN_KV_SESSIONS = 4  # a server choosing how many blocks it hosts keeps KV room for this many full sessions
MAX_PUSH_WAIT_MS = 600_000
STOPPED_STEP_RUNS = 3  # runs of one step request that a drop's exchange may stop before its StepStopped goes out


def _step_list(payload: dict[str, Any]) -> list[Any]:
    """Gives the `steps` list of a frame that carries several steps, checked for its length only."""
    steps = field(payload, "steps", list)
    if not 0 < len(steps) <= MAX_STEPS_PER_FRAME:
        raise MalformedFrame(f"a frame carries 1..{MAX_STEPS_PER_FRAME} steps, got {len(steps)}")
    return steps


def _expected_blocks(payload: dict[str, Any]) -> tuple[int, int] | None:
    """Gives the blocks a step expects its session to run over here (`blocks`, optional)."""
    return _block_pair(payload) if "blocks" in payload else None


def _block_pair(payload: dict[str, Any]) -> tuple[int, int]:
    """Gives the `blocks` field, [start, end], of a request; raises MalformedFrame unless it is two integers."""
    blocks = field(payload, "blocks", list)
    if len(blocks) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        raise MalformedFrame(f"request field 'blocks' must be [start, end] integers, got {blocks!r:.100}")
    return blocks[0], blocks[1]


class SwarmServer:
    """Owns the DHT node, the RPC endpoint, the block range, the page pool and the background loops."""

    def __init__(self, config: ServerConfig, source: ModelSource | None = None) -> None:
        self.config = config
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        self.source = source or resolve_model(config.model)
        start, end = parse_block_range(config.blocks, self.source.num_blocks) if config.blocks else (0, 0)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.gpu_profile = load_profile(config.emulate_gpu) if config.emulate_gpu else None
        min_block_pages = 1
        # Blocks load one by one into the pool's pages (`adopt`), the first ones below, more as the range changes.
        self.blocks = BlockRange(
            self.source, 0, 0, dtype=self.dtype, device=self.device, quant=config.quant,
            adopt=lambda index, tensors: self.pool.adopt(ParamsOwner(index), tensors, min_pages=min_block_pages),
        )
        if self.gpu_profile is not None:  # the profile's memory, in the served model's scale (server.emulated_gpu)
            kv_bytes = self.blocks.kv_bytes_per_token()
            budget = self.gpu_profile.pool_bytes(kv_bytes)
            min_block_pages = -(-self.gpu_profile.block_bytes(kv_bytes) // config.page_bytes)
        else:
            budget = parse_size(config.memory) if config.memory else default_budget_bytes(self.device)
        self.pool = PagePool(budget, config.page_bytes, device=self.device)
        try:
            for index in range(start, end):
                self.blocks.load_block(index)
        except OutOfPages as error:
            message = f"--memory {config.memory or budget} cannot hold blocks {start}:{end}: {error}"
            raise OutOfPages(message) from None
        self.kv = self.blocks.paged_kv(self.pool.storage, self.pool.page_bytes)
        self.sessions = SessionTable(
            block_start=start, block_end=end, pool=self.pool, tokens_per_page=self.kv.tokens_per_page,
            max_length=config.max_length, headroom_tokens=config.kv_headroom_tokens,
            quota=ClientQuota(max_sessions=config.client_max_sessions, kv_share=config.client_kv_share),
        )
        self.migrations = Migrations(self.sessions, self.kv, self.dtype, self.blocks.hidden_size,
                                     chunk_bytes=config.migration_chunk_bytes,
                                     import_idle_s=config.import_idle_timeout_s)
        self.hosting = Hosting(self.blocks, self.pool, self.sessions, load_timeout_s=config.block_change_timeout_s)
        self.sessions.pages_coming = self.hosting.retiring_pages
        self.hosting.add_listener(self._on_range_change)
        # A server that starts with no blocks measures one built outside its pool (and forgets it): the orchestrator
        # and a self-choosing server need its speed and block size before it hosts anything.
        probe = self.blocks if self.blocks.loaded else BlockRange(
            self.source, 0, 1, dtype=self.dtype, device=self.device, quant=config.quant
        )
        self.block_bytes = max(probe.block_bytes(probe.start), min_block_pages * config.page_bytes)
        if self.gpu_profile is not None:  # announced as the profile's, never measured
            speed = BlockSpeed({batch: self.gpu_profile.decode_ms(batch) for batch in DECODE_BATCHES},
                               self.gpu_profile.chunk_ms_per_token(PREFILL_CHUNK_TOKENS))
        else:
            speed = cached_block_speed(probe, self.source.model_id)
        self.block_decode_ms, self.block_prefill_ms_per_token = speed.decode_ms, speed.prefill_ms_per_token
        self.block_prefill_ms_per_token_long = speed.prefill_ms_per_token_long
        del probe
        self.max_batch_tokens = config.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS.get(self.device.type, 128)
        self.remote = RemoteAttention(self)  # the live exchange's lent KV and steps over it (KunServe)
        self.batch_trace = BatchTrace(config.batch_trace) if config.batch_trace is not None else None
        self.scheduler = StepScheduler(
            self.blocks, self.kv, self.sessions, max_batch_tokens=self.max_batch_tokens,
            # an emulated server holds each batch on the compute thread: never on the event loop
            inline_step_ms=0 if self.gpu_profile else config.inline_step_ms, block_compute_ms=self.block_decode_ms[1],
            on_steps_done=self._push_on, hold_ms=self.gpu_profile.block_ms if self.gpu_profile else None,
            remote_forward=self.remote.forward, trace=self.batch_trace.note if self.batch_trace is not None else None,
        )
        self.state = ServerState.joining
        self.ready = asyncio.Event()  # set once the server serves its first blocks
        self.network_mbps: float | None = None
        self.packing = PackingMember(self)  # its part in the KV packing of its segment
        self.dropping = DropMember(self)  # its part in its segment's block dropping (KunServe)
        self.exchange = BlockExchange(self, config.kv_exchange)  # victims' KV after a drop, merges after a restore
        self.dht: hivemind.DHT | None = None
        self._addrs: list[str] = []
        self.rpc: RpcServer | None = None
        self._steps_stopped = False  # set once a draining server has moved what it could: steps then fail over
        self.p2p: P2P | None = None
        self.announcer: Announcer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing: set[asyncio.Task[None]] = set()  # closes of parts on peers (`_close_untold_parts`)
        self.pusher: Pusher | None = None
        self.pushes_received = 0  # steps that previous servers of chains pushed here
        self.metrics: ServerMetrics | None = None
        self.metrics_port: int | None = None

    @property
    def peer_id(self) -> str:
        assert self.dht is not None
        return self.dht.peer_id.to_base58()

    def record(self) -> ServerRecord:
        """Gives the record this server announces right now."""
        stats = self.pool.stats()
        assert self.dht is not None
        return ServerRecord(
            peer_id=self.peer_id,
            model_id=self.source.model_id,
            block_start=self.hosting.start,
            block_end=self.hosting.end,
            state=self.state,
            pages_total=stats.pages_total,
            pages_params=stats.pages_params,
            pages_kv=stats.pages_kv,
            pages_free=stats.pages_free,
            sessions_fit=self.sessions.sessions_fit(),
            page_bytes=stats.page_bytes,
            kv_bytes_per_token=self.blocks.kv_bytes_per_token(),
            block_bytes=self.block_bytes,
            block_compute_ms=self.scheduler.block_compute_ms,
            block_decode_ms=[BatchTiming(batch=batch, ms=ms) for batch, ms in sorted(self.block_decode_ms.items())],
            block_prefill_ms_per_token=self.block_prefill_ms_per_token,
            block_prefill_ms_per_token_long=self.block_prefill_ms_per_token_long,
            network_mbps=self.network_mbps,
            session_count=len(self.sessions),
            max_length=self.config.max_length,
            dtype=self.blocks.dtype_name,
            quant=self.blocks.quant,
            version=SOFTWARE_VERSION,
            public_name=self.config.public_name,
            addrs=self._addrs,
            orchestrators=list(self.config.orchestrators),
            accepting=self.packing.accepting,
            kv_demand_pages=self.sessions.kv_demand_pages(),
            kv_packed_pages=stats.pages_kv + self.sessions.prompt_reserve(),
            restorable_start=self.hosting.restorable[0] if self.hosting.restorable else None,
            restorable_end=self.hosting.restorable[1] if self.hosting.restorable else None,
            segment_dropping=self.config.kv_dropping and not self.config.orchestrators,
            reshaping=self.exchange.reshaping,
            moved_in=sum(self.migrations.stats.sessions_in.values()),
            moved_out=sum(self.migrations.stats.sessions_out.values()),
            drops=self.hosting.drops,
            restores=self.hosting.restores,
            emulated_gpu=self.gpu_profile.name if self.gpu_profile else None,
        )

    async def start(self) -> None:
        """Joins the DHT, starts serving RPCs and announces the blocks as online."""
        self.dht = open_dht(  # its records are signed with its identity (`swarm.signing`)
            identity=self.config.identity,
            initial_peers=self.config.initial_peers,
            host_maddrs=self.config.host_maddrs,
            announce_maddrs=self.config.announce_maddrs or None,
        )
        self._addrs = [str(addr) for addr in self.dht.get_visible_maddrs()][:16]
        self.migrations.peer_id = self.peer_id
        p2p = self.p2p = await self.dht.replicate_p2p()
        self.rpc = RpcServer(p2p, max_frame_bytes=self.config.max_frame_bytes)
        methods = {"info": self._info, "open": self._open, "step": self._step, "steps": self._steps, "push": self._push,
                   "close": self._close, "withdraw": self._withdraw, "assign": self._assign, "drop": self._drop,
                   "restore": self._restore, "migrate": self._migrate,
                   "import_open": self._import_open, "import_kv": self._import_kv, "import_commit": self._import_commit,
                   "import_abort": self._import_abort, "kv_report": self.packing.kv_report,
                   "export": self.exchange.export, "attend_open": self._attend_open, "attend": self.remote.attend,
                   "attend_read": self.remote.read, "attend_release": self.remote.release}
        for name, method in methods.items():
            self.rpc.add_method(name, method)
        self.pusher = Pusher(
            p2p, self.announced_addrs, timeout_s=self.config.push_timeout_s,
            max_frame_bytes=self.config.max_frame_bytes, own_peer_id=self.peer_id, push_here=self._pushed_here,
        )
        await self.rpc.start()
        self.scheduler.start()
        self._update_state()
        self.announcer = Announcer(
            self.dht, self.record, period_s=self.config.announce_period_s, ttl_s=self.config.record_ttl_s
        )
        await self.announcer.start()
        self._tasks.append(asyncio.create_task(self._expire_sessions_loop(), name="expire-sessions"))
        if allocator.trims():  # jemalloc returns freed pages itself
            self._tasks.append(asyncio.create_task(self._trim_heap_loop(), name="trim-heap"))
        if self.config.metrics_port is not None:
            self.metrics = ServerMetrics(self)
            http = serve_metrics(self.metrics.registry, self.config.metrics_port, self.config.metrics_host)
            self.metrics_port = http.server_address[1]
        for loop in (self.packing.start(), self.dropping.start()):
            if loop is not None:
                self._tasks.append(loop)
        if self.config.blocks is None and not self.config.orchestrators:
            self._tasks.append(asyncio.create_task(self._choose_blocks_loop(), name="choose-blocks"))
        orchestrators = " or ".join(self.config.orchestrators)
        waiting = f"waiting for blocks from orchestrator {orchestrators}" if orchestrators else ""
        log.info(
            "Serving %s blocks %d:%d as %s on %d torch thread(s); %s; %d tokens per KV page; batches of up to %d "
            "tokens%s", self.source.model_id, self.hosting.start, self.hosting.end, self.peer_id,
            torch.get_num_threads(), self.pool.stats(), self.kv.tokens_per_page, self.max_batch_tokens,
            f"; {waiting}" if waiting and self.hosting.start == self.hosting.end else "",
        )

    def _update_state(self) -> None:
        """Online while serving blocks; joining before the first blocks arrive and while a move loads its new ones."""
        if self.state == ServerState.draining or self.rpc is None:
            return
        self.state = ServerState.online if self.hosting.end > self.hosting.start else ServerState.joining
        if self.state == ServerState.online:
            self.ready.set()

    def _on_range_change(self, old: tuple[int, int], new: tuple[int, int]) -> None:
        """Re-announces the record at once when the serving range changes."""
        self._update_state()
        log.info("blocks %d:%d -> %d:%d", *old, *new)
        if self.announcer is not None:
            task = asyncio.create_task(self.announce_now(), name="announce-range")
            self._tasks.append(task)
            task.add_done_callback(lambda done: self._tasks.remove(done) if done in self._tasks else None)

    def announce_soon(self) -> None:
        """Announces the record now, in a task of its own (a change others should see before the next period)."""
        if self.announcer is None:
            return
        task = asyncio.create_task(self.announce_now(), name="announce-now")
        self._tasks.append(task)
        task.add_done_callback(lambda done: self._tasks.remove(done) if done in self._tasks else None)

    async def announce_now(self) -> None:
        """Announces the record now (a failure is logged: the periodic announce retries)."""
        assert self.announcer is not None
        try:
            await self.announcer.announce_now()
        except SwarmError as error:
            log.warning("could not announce the new range: %s", error.message)

    def add_range_listener(self, listener: Callable[[tuple[int, int], tuple[int, int]], None]) -> None:
        """Calls `listener(old, new)` whenever the blocks this server serves change."""
        self.hosting.add_listener(listener)

    async def change_blocks(self, start: int, end: int) -> None:
        """Moves this server to blocks [start, end) while it serves (see `server.hosting`)."""
        await self.hosting.change(start, end)

    async def drop_blocks(self, start: int, end: int, *, reserve_pages: int = 0) -> list[str]:
        """Keeps only blocks [start, end) at once, their dropped neighbours' pages becoming KV pages (KunServe);
        gives the victims (see `Hosting.drop`), whose KV for the dropped blocks then moves to the servers that keep
        them (`server.exchange`), or who are evicted for a replay with `--kv-exchange replay`. With a KV exchange
        (`blocking` or `live`), `reserve_pages` of the free pages are held back from new sessions for the KV the
        group-mates' victims bring here, until those stop arriving (`SessionTable.hold_for_exchange`); not under
        `auto`, whose victims may each replay instead, which this server would not learn."""
        replay = self.config.kv_exchange == "replay"
        victims = await self.hosting.drop(start, end, evict=replay)
        # At once, as the drop returns (no other task runs in between): a drop it refused holds nothing.
        if reserve_pages and self.config.kv_exchange in ("blocking", "live"):
            self.sessions.hold_for_exchange(reserve_pages, idle_s=EXCHANGE_STUCK_S)
            log.info("Holding %d free page(s) back from new sessions for the KV the group-mates' victims bring",
                     reserve_pages)
        if victims and not replay:
            self.exchange.after_drop(victims)
        return victims

    async def restore_blocks(self, *, evict_merged: bool = False) -> list[str]:
        """Loads the blocks dropped since the last restore back and serves them again (see `Hosting.restore`),
        then takes back the buddies' parts of the sessions that run on into them (`server.exchange`)."""
        self.sessions.hold_for_exchange(0)  # the drop's exchange is over: its held pages hold blocks again
        evicted = await self.hosting.restore(evict_merged=evict_merged)
        self.exchange.after_restore()
        return evicted

    async def _check_drop_caller(self, ctx: CallContext, what: str) -> None:
        """Raises AssignmentRefused unless the caller is an orchestrator of this server or its segment's leader."""
        if ctx.peer_id in self.config.orchestrators or await self.dropping.leads_me(ctx.peer_id):
            return
        raise AssignmentRefused(f"{what} from {ctx.peer_id}, which is neither an orchestrator of server "
                                f"{self.peer_id} nor the leader of its segment; {what} ignored")

    async def _attend_open(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """RPC: keeps a lender's victim here, its KV still lent (`RemoteAttention.open`), for a lender that announces
        the blocks as its own: such a session opens whatever the free pages, so a stranger may not open one."""
        start, end = _block_pair(payload)
        if not await self.dropping.may_lend(ctx.peer_id, start, end):
            raise MigrationRefused(f"{ctx.peer_id} announces no blocks {start}:{end}, served or dropped, so it lends "
                                   f"server {self.peer_id} no KV of them; attend_open ignored")
        return await self.remote.open(payload, ctx)

    def _check_orchestrator(self, ctx: CallContext, what: str) -> None:
        """Raises AssignmentRefused unless the caller is one of the orchestrators this server follows."""
        if not self.config.orchestrators:
            raise AssignmentRefused(
                f"server {self.peer_id} chooses its blocks itself (it names no orchestrator); {what} ignored"
            )
        if ctx.peer_id not in self.config.orchestrators:
            raise AssignmentRefused(
                f"{what} from {ctx.peer_id}, but server {self.peer_id} follows orchestrator(s) "
                f"{', '.join(self.config.orchestrators)} only"
            )

    async def _assign(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """Follows the block assignment of this server's orchestrator: answers once the new range serves."""
        self._check_orchestrator(ctx, "assignment")
        start, end = _block_pair(payload)
        self._check_accepting()
        await self.change_blocks(start, end)
        return {"blocks": [self.hosting.start, self.hosting.end], "retiring": self.hosting.retiring}

    async def _drop(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """Keeps only the blocks its orchestrator's drop plan names (KunServe): answers once the others' pages are
        KV pages, or will be when the batch computing with them ends."""
        await self._check_drop_caller(ctx, "drop")
        start, end = _block_pair(payload)
        reserve = field(payload, "reserve", int, optional=True) or 0
        if not 0 <= reserve <= self.pool.stats().pages_total:
            raise MalformedFrame(f"reserve {reserve} is outside 0..{self.pool.stats().pages_total} pages")
        self._check_accepting()
        victims = await self.drop_blocks(start, end, reserve_pages=reserve)
        return {"blocks": [self.hosting.start, self.hosting.end], "victims": len(victims),
                "restorable": list(self.hosting.restorable) if self.hosting.restorable else None}

    async def _restore(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """Loads the dropped blocks back on its orchestrator's word: answers once they serve again."""
        await self._check_drop_caller(ctx, "restore")
        self._check_accepting()
        had_blocks = self.hosting.restorable is not None
        evicted = await self.restore_blocks(evict_merged=field(payload, "evict_merged", bool, optional=True) is True)
        return {"blocks": [self.hosting.start, self.hosting.end], "evicted": len(evicted), "restored": had_blocks}

    async def _choose_blocks_loop(self) -> None:
        """Chooses this server's blocks as Petals' servers do, then checks every `rebalance_period_s` whether
        another span would serve the swarm clearly better (see `orchestrator.block_selection`)."""
        num_blocks = self.source.num_blocks
        count = self.config.num_blocks or self._blocks_memory_holds()
        count = min(count, num_blocks)
        while True:
            try:
                spans = await self._hosted_spans()
                if self.hosting.end == self.hosting.start:
                    start = choose_start(spans, num_blocks, count)
                else:
                    start = better_start(spans, num_blocks, self.peer_id, balance_quality=self.config.balance_quality)
                if start is not None:
                    await self.change_blocks(start, start + count)
            except (SwarmError, ValueError) as error:
                log.warning("choosing blocks failed (retrying in %.0f s): %s", self.config.rebalance_period_s, error)
            await asyncio.sleep(self.config.rebalance_period_s)

    async def _hosted_spans(self) -> dict[str, HostedSpan]:
        """Gives the spans the model's online servers announce, this one's as it serves now."""
        assert self.dht is not None
        records = await lookup_servers_async(self.dht, self.source.model_id, timeout_s=self.config.push_timeout_s)
        spans = {
            peer: HostedSpan(record.block_start, record.block_end, record.block_compute_ms)
            for peer, record in records.items()
            if record.state == ServerState.online and peer != self.peer_id
        }
        if self.hosting.end > self.hosting.start:
            spans[self.peer_id] = HostedSpan(self.hosting.start, self.hosting.end, self.scheduler.block_compute_ms)
        return spans

    def _blocks_memory_holds(self) -> int:
        """Gives how many blocks the pool holds, each with room for the KV of `SELF_CHOSEN_KV_SESSIONS` sessions of
        the server's max_length."""
        kv_bytes_per_block = SELF_CHOSEN_KV_SESSIONS * self.config.max_length * self.blocks.kv_bytes_per_token()
        block_pages = self.pool.pages_needed(self.block_bytes)
        return blocks_that_fit(
            self.pool.pages_total * self.pool.page_bytes, block_pages * self.pool.page_bytes, kv_bytes_per_block,
            self.source.num_blocks,
        )

    async def shutdown(self) -> None:
        """Stops announcing, lets in-flight steps finish (bounded), frees every session and leaves the DHT."""
        if self.state == ServerState.draining:
            return
        self.state = ServerState.draining
        if self.announcer is not None and self.dht is not None and self.dht.is_alive():
            try:  # announces `draining` so clients route elsewhere; bounded, the DHT may already be gone
                await asyncio.wait_for(self.announcer.stop(), timeout=self.config.drain_timeout_s)
            except TimeoutError:
                log.warning("Could not announce draining within %.0f s", self.config.drain_timeout_s)
        await self.exchange.stop()
        await self._move_sessions_away()
        await self._tell_moved_clients()
        self._steps_stopped = True
        if not await self.scheduler.wait_idle(self.config.drain_timeout_s):
            log.warning("%d step(s) still running after %.0f s", self.scheduler.pending, self.config.drain_timeout_s)
        await self.scheduler.stop()
        if self.batch_trace is not None:
            self.batch_trace.close()
        await self.remote.stop()
        await self.hosting.stop()
        if self._closing:  # a drain that ended at a client's close lets the close it passed on reach the peer: at
            # most a dial and the close
            await asyncio.wait(self._closing, timeout=self.config.push_timeout_s + PEER_CALL_TIMEOUT_S)
        for task in [*self._tasks, *self._closing]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._closing, return_exceptions=True)
        await self.packing.close()
        await self.dropping.close()
        open_sessions = len(self.sessions)
        if self.pusher is not None:
            await self.pusher.close()
        if self.rpc is not None:
            await self.rpc.stop()  # closing the streams frees their sessions
        self.sessions.close_all()
        if self.p2p is not None:
            await self.p2p.shutdown()  # the replica's client socket file goes with it
        if self.dht is not None:
            self.dht.shutdown()
        log.info("Shut down; freed %d open session(s); pool %s", open_sessions, self.pool.stats())

    async def _expire_sessions_loop(self) -> None:
        period_s = max(0.2, min(5.0, self.config.session_timeout_s / 4))
        while True:
            await asyncio.sleep(period_s)
            expired = self.sessions.close_idle(self.config.session_timeout_s)
            if expired:
                log.info("Closed %d idle session(s) after %.0f s", len(expired), self.config.session_timeout_s)
            self.packing.check_orphaned()
            dropped = self.migrations.expire_imports()
            if dropped:
                log.info("Dropped %d import(s) whose source went silent", len(dropped))
            forgotten = self.remote.expire()
            if forgotten:
                log.info("Freed the lent KV of %d block(s) whose keeper went silent", forgotten)
            self._close_untold_parts([])  # of sessions closed otherwise than by their clients' `close`

    @staticmethod
    async def _trim_heap_loop() -> None:
        """Hands freed C heap back to the OS now and then (`server.allocator`), off the event loop's thread."""
        while True:
            await asyncio.sleep(allocator.TRIM_PERIOD_S)
            await asyncio.to_thread(allocator.trim)

    def _check_serving(self) -> None:
        # A server that moves its range keeps running the sessions of the blocks it leaves, even while it serves
        # no new ones (joining); a server that shuts down runs its sessions' steps until it has moved them away.
        if self._steps_stopped:
            raise ServerDraining(f"server {self.peer_id} is {self.state.value}; retry on another server")

    def _check_accepting(self) -> None:
        if self.state == ServerState.draining:
            raise ServerDraining(f"server {self.peer_id} is {self.state.value}; open the session on another server")

    async def _info(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        stats = self.scheduler.stats
        return {"record": self.record().to_wire(), "num_blocks": self.source.num_blocks,
                "steps_computed": {place: stats.steps_by_place[place] for place in ("loop", "pool", "remote")},
                "batches": stats.to_wire(), "kv_tokens_per_page": self.kv.tokens_per_page,
                "migrations": self.migrations.stats.to_wire(),
                "packing": self.packing.loop.to_wire() if self.packing.loop is not None else None,
                "dropping": {"drops": self.hosting.drops, "restores": self.hosting.restores,
                             "restorable": list(self.hosting.restorable) if self.hosting.restorable else None,
                             "loop": self.dropping.loop.to_wire() if self.dropping.loop is not None else None,
                             "reshaping": self.exchange.reshaping, "exchange": self.exchange.stats.to_wire(),
                             "held_for_exchange": self.sessions.held_for_exchange(),
                             "live": self.remote.stats.to_wire(),
                             "refused": refused_digests(self.sessions.refused()),
                             "opened": opened_digests(self.sessions.opened())}}

    async def _open(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        self._check_accepting()
        session_id = field(payload, "session_id", str, optional=True) or uuid.uuid4().hex
        if len(session_id) > 128:
            raise MalformedFrame("session_id is longer than 128 characters")
        start, end = _block_pair(payload)
        max_length = field(payload, "max_length", int)
        batch = field(payload, "batch", int, optional=True) or 1
        prompt_tokens = field(payload, "prompt_tokens", int, optional=True) or 0
        if prompt_tokens < 0:
            raise MalformedFrame(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        moved_in = bool(field(payload, "moved_from", str, optional=True))  # a replay of a session handed over here
        lease_id = field(payload, "lease_id", str, optional=True)
        if lease_id is not None and len(lease_id) > 128:
            raise MalformedFrame("lease_id is longer than 128 characters")
        wait_id = field(payload, "wait_id", str, optional=True) or ""
        if len(wait_id) > 128:
            raise MalformedFrame("wait_id is longer than 128 characters")
        session = self.sessions.open(session_id, start, end, batch=batch, max_length=max_length,
                                     opener=ctx.peer_id, prompt_tokens=prompt_tokens, moved_in=moved_in,
                                     wait_id=wait_id)
        session.lease_id = lease_id
        if moved_in:
            self.migrations.note_replayed_in(session_id)
        ctx.add_close_callback(lambda: self.sessions.close(session_id))
        return {"session_id": session_id, "blocks": [start, end], "max_length": max_length, "position": 0}

    async def _close(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        session_id = field(payload, "session_id", str)
        departure = self.migrations.untold_departure(session_id)
        if departure is None:
            self.sessions.get(session_id)  # raises SessionNotFound for unknown or already closed sessions
            self.sessions.close(session_id)
        self._close_untold_parts([(session_id, *departure)] if departure is not None else [])
        return {}

    def _close_untold_parts(self, parts: list[tuple[str, str, list[str]]]) -> None:
        """Closes, in the background, `parts` and the parts that closed sessions left on other servers untold to
        their clients (`SessionTable.take_untold_parts`): (session id, peer id, addresses) each."""
        parts = parts + self.sessions.take_untold_parts()
        if not parts or self.p2p is None:
            return
        p2p, timeout_s, max_frame_bytes = self.p2p, self.config.push_timeout_s, self.config.max_frame_bytes

        async def close_one(session_id: str, peer_id: str, addrs: list[str]) -> None:
            try:
                connection = await dial(p2p, peer_id, addrs, timeout=timeout_s, max_frame_bytes=max_frame_bytes)
            except SwarmError as error:  # gone: what it held went with it
                log.debug("could not reach %s to close session %s: %s", peer_id, session_id, error.message)
                return
            try:
                await close_remote(connection, session_id)
            finally:
                await connection.close()
            log.info("Closed session %s's part on %s, which its client was never told of", session_id, peer_id)

        async def close_all() -> None:
            await asyncio.gather(*(close_one(*part) for part in parts))

        task = asyncio.create_task(close_all(), name="close-untold")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _withdraw(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """A client whose wait this server refused opened it on another: the wait leaves the line here."""
        wait_id = field(payload, "wait_id", str)
        if len(wait_id) > 128:
            raise MalformedFrame("wait_id is longer than 128 characters")
        return {"withdrawn": self.sessions.withdraw(wait_id, ctx.peer_id)}

    async def _step(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """Runs a step (or finds it running or done, if a push brought it first) and answers its output.

        A step without `hidden` but with `wait_ms` waits up to that long for the previous server to push it.
        """
        compression = validate_compression(field(payload, "compression", str, optional=True))
        output = field(payload, "output", str, optional=True) or "all"
        if output not in ("all", "last"):
            raise MalformedFrame(f"output {output!r} is neither 'all' nor 'last'")
        session_id, blocks = field(payload, "session_id", str), _expected_blocks(payload)
        runs = 0
        while True:
            await self.migrations.wait_if_moving(session_id, blocks)
            if "hidden" not in payload and "wait_ms" in payload:
                session, result = await self._await_pushed_step(payload)
            else:
                session, result = self._admit_step(payload, ctx)
            try:
                return await self._step_reply(session, result, compression, last_only=output == "last")
            except StepStopped:  # a drop moves the session's blocks: ChainChanged once they moved, or it runs again
                runs += 1
                if runs == STOPPED_STEP_RUNS:
                    raise

    async def _steps(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """Runs `steps`, a list of `step` payloads of any sessions on this server (a client sends the steps of its
        sessions that go on together in one frame), and answers `results`: for each, what `step` answers, or
        `error`. All are admitted before any computes, so they start in one batch; each fails on its own."""
        # The tasks run in order once this awaits the first; each admits its step before it waits, so all are queued
        # before the scheduler's task runs.
        replies = [asyncio.ensure_future(self._entry_reply(entry, ctx)) for entry in _step_list(payload)]
        results = []
        for reply in replies:
            try:
                results.append(await reply)
            except SwarmError as error:
                results.append({"error": error.to_wire()})
            except Exception as error:  # a bug in one step's handling must not take the others' replies with it
                log.exception("a step of a steps frame failed")
                results.append({"error": InternalServerError(f"{type(error).__name__}: {error}").to_wire()})
        return {"results": results}

    async def _entry_reply(self, entry: object, ctx: CallContext) -> dict[str, Any]:
        if not isinstance(entry, dict):
            raise MalformedFrame(f"a step in a steps frame is not a map: {entry!r:.100}")
        return await self._step(entry, ctx)

    async def _step_reply(
        self, session: Session, result: asyncio.Future[StepResult], compression: str | None, *,
        last_only: bool = False,
    ) -> dict[str, Any]:
        step = await asyncio.shield(result)  # a client that goes away does not cancel a step others await
        output = step.output[:, -1:] if last_only else step.output
        return {"hidden": encode_tensor(output.contiguous(), compression), "position": session.position,
                "compute_ms": step.compute_ms, "batches": step.batches}

    async def _push(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """Accepts steps pushed by the previous server of a chain (a notification: its reply is not sent) and
        computes them in the background: one step, or `steps`, a list of them that a batch there finished."""
        self._accept_pushed(payload, ctx)
        return {}

    def _pushed_here(self, payload: dict[str, Any]) -> None:
        """Accepts steps this server pushed to itself: the next span of their chains is on this server too."""
        try:
            self._accept_pushed(payload, CallContext(self.peer_id, -1))
        except SwarmError as error:  # as for a push from another server: the client's own copy of the step follows
            log.debug("pushed step refused: %s: %s", type(error).__name__, error.message)

    def _accept_pushed(self, payload: dict[str, Any], ctx: CallContext) -> None:
        steps = payload.get("steps")
        self.pushes_received += len(steps) if isinstance(steps, list) else 1
        if "steps" not in payload:
            validate_compression(field(payload, "compression", str, optional=True))
            self._admit_step(payload, ctx)
            return
        for step in _step_list(payload):  # each on its own: one that cannot run does not keep the others from running
            try:
                if not isinstance(step, dict):
                    raise MalformedFrame(f"a pushed step is not a map: {step!r:.100}")
                validate_compression(field(step, "compression", str, optional=True))
                self._admit_step(step, ctx)
            except SwarmError as error:
                log.debug("pushed step refused: %s: %s", type(error).__name__, error.message)

    def _known_step(self, session: Session, step_id: str | None) -> asyncio.Future[StepResult] | None:
        """Gives the result of step `step_id` if the session has done it or is running it now, else None."""
        if step_id is None:
            return None
        if step_id == session.last_step_id and session.last_result is not None:
            session.last_active_s = time.monotonic()  # a repeated step: answer again, compute nothing
            done = asyncio.get_running_loop().create_future()
            done.set_result(session.last_result)
            return done
        if session.running is not None and session.running.step_id == step_id:
            return session.running.result
        return None

    async def _await_pushed_step(self, payload: dict[str, Any]) -> tuple[Session, asyncio.Future[StepResult]]:
        """Gives the result of a step the previous server is to push, waiting at most `wait_ms` for it to arrive."""
        self._check_serving()
        self.migrations.check_step(field(payload, "session_id", str), _expected_blocks(payload))
        session = self.sessions.get(field(payload, "session_id", str))
        step_id = field(payload, "step_id", str)
        wait_ms = field(payload, "wait_ms", int)
        if not 0 <= wait_ms <= MAX_PUSH_WAIT_MS:
            raise MalformedFrame(f"wait_ms {wait_ms} is outside 0..{MAX_PUSH_WAIT_MS}")
        deadline = time.monotonic() + wait_ms / 1000
        while (known := self._known_step(session, step_id)) is None:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise StepNotPushed(f"step {step_id!r} was not pushed within {wait_ms} ms; send its hidden states")
            with suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(session.admitted), remaining_s)
            self.migrations.check_step(session.session_id, _expected_blocks(payload))  # it may have moved away
            session = self.sessions.get(session.session_id)  # or closed meanwhile
        return session, known

    def _admit_step(
        self, payload: dict[str, Any], ctx: CallContext
    ) -> tuple[Session, asyncio.Future[StepResult]]:
        """Gives the session and the future result of the step in `payload`: done, running, or started now.

        Raises the typed error of a step that cannot run; nothing about the session changes then.
        """
        self._check_serving()
        session_id = field(payload, "session_id", str)
        self.migrations.check_step(session_id, _expected_blocks(payload))
        session = self.sessions.get(session_id)
        step_id = field(payload, "step_id", str, optional=True)
        known = self._known_step(session, step_id)
        if known is not None:
            return session, known
        if session.moving is not None or session.awaiting_exchange is not None:
            raise ServerBusy(f"session {session_id!r} is moving to another server; ask for its step again")
        running = session.running
        if running is not None:
            raise ServerBusy(f"session {session.session_id!r} is already running step {running.step_id!r}")
        try:
            next_hops = NextHop.list_from_wire(payload.get("next", []))
            then = NextHop.list_from_wire(payload.get("then", []))  # the servers after this one, without a push
        except ValueError as error:
            raise MalformedFrame(str(error)) from None
        following = next_hops or then
        session.next_hop = following[0] if following else None
        session.later_hops = len(following)
        hidden = self._decode_hidden(payload, session)
        position = field(payload, "position", int, optional=True)
        if position is not None and position != session.position:
            raise PositionMismatch(f"step starts at position {position}, but the session is at {session.position}")
        if session.position + hidden.shape[1] > session.max_length:
            raise MaxLengthExceeded(
                f"{session.position} + {hidden.shape[1]} tokens exceed the session's max_length {session.max_length}"
            )
        # The step's pages are taken now, all or none: a step that cannot have them fails alone, at once, instead of
        # taking the pool's last pages chunk by chunk from the sessions already running.
        self.sessions.grow(session, session.position + hidden.shape[1])
        self._note_throughput(ctx)
        session.last_active_s = time.monotonic()
        result: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        step = Step(session, step_id, hidden, result, next_hops=next_hops, compression=payload.get("compression"))
        session.running = step
        session.admitted.set_result(None)  # wakes requests waiting for this step to be pushed
        session.admitted = asyncio.get_running_loop().create_future()
        self.scheduler.submit(step)
        return session, result

    async def _migrate(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """Moves a session to server `peer_id` (which hosts its blocks), `mode` "kv" (its KV travels), "replay" (its
        client replays there) or "auto" (the default: the one `choose_mode` expects to end first); asked by the
        session's client or by an orchestrator this server follows. Answers once the destination serves it (kv) or
        the session left (replay), with the mode taken and, for "auto", both modes' expected seconds."""
        self._check_serving()
        session = self.sessions.get(field(payload, "session_id", str))
        allowed = (session.opener, *self.config.orchestrators)
        if ctx.peer_id not in allowed and not await self.packing.leads_me(ctx.peer_id):
            raise MigrationRefused(f"only the session's client, this server's orchestrator or its segment's leader "
                                   f"may move it, not {ctx.peer_id}")
        peer_id = field(payload, "peer_id", str)
        if peer_id == self.peer_id:
            raise MalformedFrame("a session cannot move to the server it is on")
        mode = field(payload, "mode", str, optional=True) or AUTO
        if mode not in (*MODES, AUTO):
            raise MalformedFrame(f"migration mode {mode!r} is none of {', '.join((*MODES, AUTO))}")
        position = session.position
        choice = await self.migrate_session(session, peer_id, mode)
        if ctx.peer_id == session.opener:  # the client asked: it learns where the session went from this reply
            self.migrations.unclaimed.discard(session.session_id)
        return {"peer_id": peer_id, "position": position, **choice.to_wire()}

    async def migrate_session(self, session: Session, peer_id: str, mode: str = AUTO) -> MoveChoice:
        """Moves `session` to server `peer_id`, found in the DHT as a host of its first block; gives the mode taken."""
        addrs = await self.announced_addrs(peer_id, session.start)
        if addrs is None:
            raise PeerUnreachable(f"server {peer_id} announces no block {session.start} of {self.source.model_id}")
        assert self.p2p is not None, "the server moves sessions only once started"
        connection = await dial(self.p2p, peer_id, addrs, timeout=self.config.push_timeout_s,
                                max_frame_bytes=self.config.max_frame_bytes)
        try:
            rtt_s, destination = await self._probe(connection)
            choice = self._choose_mode(session, peer_id, rtt_s, destination) if mode == AUTO else MoveChoice(mode)
            if choice.mode == "replay":
                self._check_room_for_replay(session, destination)
                await self.migrations.hand_over(session, peer_id, addrs)
            else:
                await self.migrations.send(session, connection, addrs, timeout_s=self.config.push_timeout_s,
                                           rtt_s=rtt_s)
        finally:
            await connection.close()
        return choice

    def _check_room_for_replay(self, session: Session, destination: ServerRecord | None) -> None:
        """Raises ServerBusy, keeping the session here, when the destination's fresh record shows too few free pages
        for the session as it is now: a replay hands the session over before the destination has taken anything."""
        if destination is None:
            return
        needed = self.sessions.pages_for(session, session.position)
        if destination.pages_free < needed:
            raise ServerBusy(f"server {destination.peer_id} has {destination.pages_free} free KV pages, session "
                             f"{session.session_id!r} needs {needed} there; it stays here")

    async def _probe(self, connection: RpcConnection) -> tuple[float, ServerRecord | None]:
        """Gives the round-trip time to the server at the other end (an `info` call on a warm stream) and its fresh
        record."""
        await connection.call("info", {}, timeout=self.config.push_timeout_s)  # the first call opens the stream
        started = time.perf_counter()
        reply = await connection.call("info", {}, timeout=self.config.push_timeout_s)
        rtt_s = time.perf_counter() - started
        record = ServerRecord.from_wire(reply.get("record"))
        return rtt_s, record if record is not None and record.peer_id == connection.peer_id else None

    def _choose_mode(self, session: Session, peer_id: str, rtt_s: float,
                     destination: ServerRecord | None) -> MoveChoice:
        """Picks the mode of a move of `session` to `peer_id` from the measured link and the destination's measured
        prefill speed (this server's own if the destination announces none)."""
        costs = self.move_costs_of(session, peer_id, rtt_s, destination)
        mode = choose_mode(costs, session.position, self.peer_id, peer_id)
        self.migrations.stats.chosen[mode] += 1
        log.info("Moving session %s (%d tokens) to %s by %s: expected %.3f s by KV transfer, %.3f s by replay "
                 "(RTT %.1f ms, %.1f Mbit/s)", session.session_id, session.position, peer_id, mode,
                 costs.kv_seconds(session.position), costs.replay_seconds(session.position), rtt_s * 1000,
                 costs.bandwidth_bytes_per_s * 8 / 1e6)
        return MoveChoice(mode, costs.kv_seconds(session.position), costs.replay_seconds(session.position))

    def move_costs_of(self, session: Session, peer_id: str, rtt_s: float, destination: ServerRecord | None, *,
                      kv_blocks: int | None = None) -> MigrationCosts:
        """Prices moving `session` (its KV of `kv_blocks` of its blocks, default all) to `peer_id` against a replay
        of the whole session there, from the measured link and the destination's measured prefill speed (this
        server's own if the destination announces none)."""
        blocks = session.end - session.start
        prefill_ms = replay_prefill_ms_per_token(destination or self.record(), session.position)
        bandwidth = self.migrations.links.bytes_per_s(
            peer_id, self.network_mbps, destination.network_mbps if destination is not None else None)
        return move_costs(
            kv_bytes_per_token=self.migrations.token_bytes(session) * (kv_blocks or blocks) // blocks,
            bandwidth_bytes_per_s=bandwidth, rtt_s=rtt_s, prefill_s_per_token=prefill_ms * blocks / 1000,
            replay_bytes_per_token=session.batch * self.blocks.hidden_size * torch.finfo(self.dtype).bits // 8,
            chunk_bytes=self.migrations.chunk_bytes,
        )

    async def _move_sessions_away(self) -> None:
        """Moves every open session with its KV to a peer that hosts its blocks and has room (the most room
        first), within --drain-timeout; a session no peer takes stays, and its client replays it elsewhere."""
        if not len(self.sessions) or self.p2p is None or self.dht is None:
            return
        deadline = time.monotonic() + self.config.drain_timeout_s
        try:
            records = await lookup_servers_async(self.dht, self.source.model_id, timeout_s=self.config.push_timeout_s)
        except SwarmError as error:
            log.warning("Draining: no peers found to move sessions to (%s); their clients will replay them",
                        error.message)
            return
        peers = sorted((r for r in records.values() if r.peer_id != self.peer_id and r.state == ServerState.online),
                       key=lambda r: (-r.sessions_fit, r.peer_id))
        moved = 0
        for session in list(self.sessions):
            if session.importing_from is not None:
                continue
            for record in (r for r in peers if r.block_start <= session.start and session.end <= r.block_end):
                if time.monotonic() > deadline:
                    break
                try:
                    await asyncio.wait_for(self.migrate_session(session, record.peer_id, "kv"),
                                           max(0.1, deadline - time.monotonic()))
                    moved += 1
                    break
                except (SwarmError, TimeoutError) as error:
                    log.info("Draining: %s did not take session %s (%s)", record.peer_id, session.session_id,
                             getattr(error, "message", type(error).__name__))
        if moved or len(self.sessions):
            log.info("Draining: moved %d session(s) with their KV; %d left to replay elsewhere", moved,
                     len(self.sessions))

    async def _tell_moved_clients(self) -> None:
        """Stays up (within --drain-timeout) until the clients of the sessions it moved have sent a step here and
        learned where their session went: a client that finds this server gone replays instead."""
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.migrations.unclaimed and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.migrations.unclaimed:
            log.info("Draining: %d moved session(s) sent no step before the deadline; their clients will replay",
                     len(self.migrations.unclaimed))

    async def _import_open(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        self._check_accepting()
        session_id = field(payload, "session_id", str)
        if len(session_id) > 128:
            raise MalformedFrame("session_id is longer than 128 characters")
        start, end = _block_pair(payload)
        client = field(payload, "client", str, optional=True) or ctx.peer_id
        lease_id = field(payload, "lease_id", str, optional=True)
        if len(client) > 128 or len(lease_id or "") > 128:
            raise MalformedFrame("client or lease_id is longer than 128 characters")
        self.migrations.open_import(
            ctx.peer_id, session_id, start, end, batch=field(payload, "batch", int),
            max_length=field(payload, "max_length", int), position=field(payload, "position", int),
            client=client, lease_id=lease_id, merge=field(payload, "merge", bool, optional=True) is True,
        )
        return {}

    async def _import_kv(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        session_id = field(payload, "session_id", str)
        pieces = payload.get("pieces")
        if not isinstance(pieces, list) or not 1 <= len(pieces) <= MAX_PIECES_PER_FRAME:
            raise MalformedFrame(f"import_kv carries 'pieces', a list of 1..{MAX_PIECES_PER_FRAME} maps")
        for piece in pieces:
            if not isinstance(piece, dict):
                raise MalformedFrame(f"a piece of KV is not a map: {piece!r:.100}")
            self.migrations.write_kv(ctx.peer_id, session_id, field(piece, "block", int), field(piece, "row", int),
                                     field(piece, "start", int), piece.get("keys"), piece.get("values"))
        return {}

    async def _import_commit(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        session = self.migrations.commit(
            ctx.peer_id, field(payload, "session_id", str), field(payload, "position", int),
            field(payload, "last_step_id", str, optional=True), payload.get("last_output"),
        )
        return {"position": session.position}

    async def _import_abort(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        self.migrations.abort(ctx.peer_id, field(payload, "session_id", str))
        return {}

    def _push_on(self, steps: list[Step]) -> None:
        """Sends finished steps' outputs to the next servers of their chains; the steps of one batch bound for one
        server go in one frame, so that they reach it together and compute together there too. A step without an
        id cannot be matched with the client's own copy of it, so it is never pushed."""
        if self.pusher is None:
            return
        pushes = []
        for step in steps:
            session, result = step.session, step.session.last_result
            if not step.next_hops or step.step_id is None or result is None or not self.sessions.is_open(session):
                continue
            push = {"step_id": step.step_id, "position": session.position - step.tokens,
                    "hidden": encode_tensor(result.output, step.compression)}
            if step.compression is not None:
                push["compression"] = step.compression
            pushes.append((step.next_hops, push, session.end))
        self.pusher.push_all(pushes)

    async def announced_addrs(self, peer_id: str, block: int) -> list[str] | None:
        """Gives the addresses `peer_id` announced in the DHT for `block` of this model, None if it did not."""
        assert self.dht is not None
        try:
            records = await lookup_block_async(
                self.dht, self.source.model_id, block, timeout_s=self.config.push_timeout_s
            )
        except SwarmError as error:
            log.debug("DHT lookup of block %d for a push failed: %s", block, error.message)
            return None
        record = records.get(peer_id)
        return None if record is None else list(record.addrs)

    def _decode_hidden(self, payload: dict[str, Any], session: Session) -> torch.Tensor:
        if "hidden" not in payload:
            raise MalformedFrame("request field 'hidden' is missing")
        max_elements = session.batch * session.max_length * self.blocks.hidden_size
        hidden = decode_tensor(payload["hidden"], max_elements=max_elements)
        if hidden.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise InvalidTensor(f"hidden states must be float32, float16 or bfloat16, got {hidden.dtype}")
        expected = f"[{session.batch}, tokens >= 1, {self.blocks.hidden_size}]"
        if hidden.dim() != 3 or hidden.shape[0] != session.batch or hidden.shape[2] != self.blocks.hidden_size:
            raise InvalidTensor(f"hidden states have shape {list(hidden.shape)}, expected {expected}")
        if hidden.shape[1] == 0:
            raise InvalidTensor(f"hidden states hold no tokens, expected {expected}")
        return hidden.to(self.blocks.dtype)

    def _note_throughput(self, ctx: CallContext) -> None:
        if ctx.request_bytes >= _THROUGHPUT_MIN_BYTES and ctx.request_read_s > 0:
            sample = ctx.request_bytes * 8 / ctx.request_read_s / 1e6
            self.network_mbps = sample if self.network_mbps is None else 0.8 * self.network_mbps + 0.2 * sample

