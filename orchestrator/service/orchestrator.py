"""`swarm-orchestrator`'s service: places blocks on the servers that follow it and dispatches every session by JFFC.

Every `refresh_period_s` it reads the model's servers from the DHT, keeps those that name it (`--orchestrator`),
measures its RTT to each new one, and estimates the arrival rate and the mean job from the sessions it served
(`orchestrator.observed_load`). From these it builds the policies' model (`orchestrator.live_model`) and composes the
swarm with the very functions `swarm-sim` runs: c tuned (`orchestrator.tuning`), GBP-CR (+ spare chains), GCA. It
re-plans when a follower joins or leaves, and when the tuned c for the observed rate differs from the plan's, that
rate moved by more than `rate_hysteresis` since the plan, and the plan has run for a whole `rate_window_s` (so the
rate was measured under it: a re-plan pauses dispatch, and closed-loop clients arrive as fast as the chains serve
them, so an earlier look would chase the echo of the re-plan itself: c swung between 2 and 10 every 15 s under three
steady chat clients). A re-plan hands each role to the server of that kind
that keeps most of its blocks, and moves servers in an order that keeps every block served
(`orchestrator.replan`); dispatch pauses while blocks move. Sessions ask for a chain (`acquire`) and get a lease by
JFFC at once, or wait in the one queue (`orchestrator.service.leases`).

Its state lives in the DHT and the servers, not in a file: a restarted orchestrator reads the servers' ranges and
plans from them, moving as little as it can. Of several orchestrators of one model, the one that started first is
active; the others answer `NotActiveOrchestrator` and take over when its record expires.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from orchestrator.allocation import gca
from orchestrator.baselines.jffc import whole_model_chains
from orchestrator.buddy.segment_loop import segment_of
from orchestrator.dispatch_policy import NoFeasiblePlan, batch_slopes
from orchestrator.live_model import JobSizes, server_spec, swarm_model
from orchestrator.observed_load import ObservedLoad
from orchestrator.packing import Migration
from orchestrator.packing.segment_loop import Report, SegmentPackingLoop
from orchestrator.replan import Range, match_roles, move_order, placement_ranges
from orchestrator.service.dropping import FollowerDropping
from orchestrator.service.leases import LeaseTable, LiveChain
from orchestrator.swarm_model import Chain, Placement, SwarmModel, per_ms
from orchestrator.tuning import (
    TunedPlan,
    TuningMethod,
    capacity_limit,
    plan_for_capacity,
    response_bounds_ms,
    tune_capacity,
)
from swarm.dht import announce_orchestrator_async, lookup_orchestrators_async, lookup_servers_async
from swarm.errors import MalformedFrame, NoRouteFound, PeerUnreachable, ServerBusy, SwarmError
from swarm.model import resolve_model
from swarm.records import SOFTWARE_VERSION, OrchestratorRecord, ServerRecord, ServerState, active_orchestrator
from swarm.rpc import CallContext, RpcConnection, RpcServer, dial
from swarm.signing import open_dht

log = logging.getLogger(__name__)

TUNING: dict[str, TuningMethod] = {"proposed": "lower_bound", "proposed-spare": "overflow"}
VARIANTS = (*TUNING, "jffc-only")  # jffc-only: the paper's baseline, the whole model on every server that fits it
# Servers may swap roles in a re-plan when their memory is within 25% (it sets how many blocks a role holds) and their
# compute time per block within 2x. Their RTTs may differ: a swap changes which chains are the fastest, which GCA and
# JFFC then account for, while moving blocks costs loading them; and a measured RTT moves by 2x from round to round
# on a busy host.
SIMILAR_MEMORY, SIMILAR_TIME = 1.25, 2.0
MAX_WAIT_S = 3600.0
MAX_MISSES = 3  # refreshes in a row a follower may miss before the plan drops it (its DHT record may live on)


class NotActiveOrchestrator(SwarmError):
    """This orchestrator stands by: another one of the model is active (ask that one)."""


@dataclass
class OrchestratorConfig:
    """What `swarm-orchestrator` serves and how it behaves; every period and timeout is a setting."""

    model: str
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity: Path | None = None
    variant: str = "proposed-spare"  # "proposed": the paper's Alg. 1, c by the lower bound; "-spare": spare chains,
    # c by the overflow estimate (see orchestrator.sim.methods)
    rho_bar: float = 0.7
    prior_rate_per_s: float = 0.2
    prior_prompt_tokens: float = 128.0
    prior_output_tokens: float = 128.0
    rate_window_s: float = 60.0
    cache_tokens: int | None = None  # KV tokens a job is planned to hold per block; None: the observed mean job
    rate_hysteresis: float = 0.25
    refresh_period_s: float = 5.0
    announce_period_s: float = 10.0
    record_ttl_s: float = 30.0
    metrics_port: int | None = None  # serve Prometheus metrics there (0: any free port)
    metrics_host: str = "127.0.0.1"
    lease_ttl_s: float = 30.0
    request_timeout_s: float = 15.0
    block_change_timeout_s: float = 300.0
    kv_packing: str | None = None  # mell, bf, wf or lb: pack the sessions of the followers that host one segment
    batch_aware: bool = True  # JFFC ranks chains by their service time at the batches their servers run now
    packing_epoch_s: float = 1.0
    kv_dropping: bool = False  # KunServe: the followers of one segment drop blocks under a KV burst, by its word
    drop_period_s: float = 0.5
    restore_after_s: float = 10.0
    restore_calm_s: float = 15.0


@dataclass(frozen=True)
class LivePlan:
    """The plan the swarm runs: c, the ranges assigned, the chains and their response bounds."""

    c: int
    method: str
    ranges: dict[str, Range]
    chains: tuple[LiveChain, ...]
    lower_ms: float
    upper_ms: float
    rate_per_s: float
    servers: frozenset[str]  # the followers it was made for
    installed_s: float  # time.monotonic() when it was installed


def _chains_over(model: SwarmModel, ranges: dict[str, Range]) -> list[Chain]:
    """Gives GCA's chains over the ranges the servers actually serve (none if they cannot hold them as modelled)."""
    placement = Placement({peer: (start + 1, end - start) for peer, (start, end) in ranges.items()})
    try:
        return gca(model, placement) if ranges else []
    except ValueError as error:  # a server serves more blocks than the model says its memory holds
        log.warning("no chains over %s: %s", ranges, error)
        return []


def _similar(swarm: SwarmModel) -> Callable[[str, str], bool]:
    """Gives whether two servers of `swarm` may swap roles in a placement."""

    def within(first: float, second: float, factor: float) -> bool:
        return max(first, second) <= factor * max(min(first, second), 1e-9)

    def similar(name: str, other: str) -> bool:
        a, b = swarm.server(name), swarm.server(other)
        return within(a.memory_gb, b.memory_gb, SIMILAR_MEMORY) and within(a.tau_p_ms, b.tau_p_ms, SIMILAR_TIME)

    return similar


class Orchestrator:
    """The live orchestrator of one model: DHT node, RPC methods, and the refresh, announce and lease loops."""

    def __init__(self, config: OrchestratorConfig) -> None:
        if config.variant not in VARIANTS:
            raise ValueError(f"unknown variant {config.variant!r}; choose from {', '.join(VARIANTS)}")
        self.config = config
        source = resolve_model(config.model)
        self.model_id, self.num_blocks = source.model_id, source.num_blocks
        self.load = ObservedLoad(
            config.prior_rate_per_s, JobSizes(config.prior_prompt_tokens, config.prior_output_tokens),
            window_s=config.rate_window_s, started_s=time.monotonic(),
        )
        self.leases = LeaseTable(config.lease_ttl_s)
        self.plan: LivePlan | None = None
        self.followers: dict[str, ServerRecord] = {}
        self.rtt_ms: dict[str, tuple[float, float]] = {}  # peer -> (rtt, measured at)
        self.active = False
        self.dht: hivemind.DHT | None = None
        self.p2p: P2P | None = None
        self.rpc: RpcServer | None = None
        self._started_at = 0.0
        self._addrs: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._connections: dict[str, RpcConnection] = {}
        self._misses: dict[str, int] = {}  # consecutive refreshes a follower did not answer
        self._refreshed = asyncio.Event()
        self.packings: dict[Range, SegmentPackingLoop] = {}  # per segment two or more followers host exactly
        self._packing_connections: dict[str, RpcConnection] = {}
        self._lease_of: dict[str, str] = {}  # server session id -> the lease its client runs it under
        self.dropping: FollowerDropping | None = None  # with --kv-dropping, once started

    @property
    def peer_id(self) -> str:
        assert self.dht is not None
        return self.dht.peer_id.to_base58()

    def record(self) -> OrchestratorRecord:
        return OrchestratorRecord(peer_id=self.peer_id, model_id=self.model_id, started_at=self._started_at,
                                  version=SOFTWARE_VERSION, addrs=self._addrs)

    async def start(self) -> None:
        """Joins the DHT, serves its RPC methods, announces itself and starts its loops."""
        self.dht = open_dht(  # its record is signed with its identity (`swarm.signing`)
            identity=self.config.identity, initial_peers=self.config.initial_peers,
            host_maddrs=self.config.host_maddrs, announce_maddrs=self.config.announce_maddrs or None,
        )
        self._started_at = get_dht_time()
        self._addrs = [str(addr) for addr in self.dht.get_visible_maddrs()][:16]
        self.p2p = await self.dht.replicate_p2p()
        self.rpc = RpcServer(self.p2p)
        for name, method in {"acquire": self._acquire, "renew": self._renew, "release": self._release,
                             "plan": self._plan, "info": self._plan}.items():
            self.rpc.add_method(name, method)
        await self.rpc.start()
        await self._announce()
        loops = [(self._announce_loop, "announce"), (self._refresh_loop, "refresh"),
                 (self._expire_loop, "expire-leases")]
        if self.config.kv_packing:
            loops.append((self._packing_loop, "kv-packing"))
        if self.config.kv_dropping:
            self.dropping = FollowerDropping(
                self.peer_id, fresh=self._fresh, call=self._call, queued_tokens=self._queued_tokens,
                period_s=self.config.drop_period_s, restore_after_s=self.config.restore_after_s,
                restore_calm_s=self.config.restore_calm_s,
            )
            loops.append((self._dropping_loop, "kv-dropping"))
        for loop, name in loops:
            self._tasks.append(asyncio.create_task(loop(), name=name))

    async def shutdown(self) -> None:
        """Stops the loops, the RPC endpoint and the DHT node (leases simply end with it)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for connection in (*self._connections.values(), *self._packing_connections.values()):
            await connection.close()
        if self.rpc is not None:
            await self.rpc.stop()
        if self.p2p is not None:
            await self.p2p.shutdown()  # the replica's client socket file goes with it
        if self.dht is not None:
            self.dht.shutdown()

    async def wait_refreshed(self, timeout_s: float) -> bool:
        """Gives whether a refresh finished within `timeout_s` (for callers that need a first plan)."""
        self._refreshed.clear()
        try:
            await asyncio.wait_for(self._refreshed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    # ---- loops ----

    async def _announce(self) -> None:
        assert self.dht is not None
        try:
            await announce_orchestrator_async(self.dht, self.record(), ttl_s=self.config.record_ttl_s)
        except SwarmError as error:
            log.warning("could not announce the orchestrator: %s", error.message)

    async def _announce_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.announce_period_s)
            await self._announce()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.2, self.config.lease_ttl_s / 4))
            for lease in self.leases.expire(time.monotonic()):
                log.info("lease %s expired (its client stopped renewing it)", lease.lease_id)

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a failed round must not end the loop: the next one retries
                log.exception("refresh failed")
            self._refreshed.set()
            await asyncio.sleep(self.config.refresh_period_s)

    async def refresh(self) -> None:
        """Reads the swarm, decides whether this orchestrator is active, and re-plans when the rule says so."""
        assert self.dht is not None
        timeout_s = self.config.request_timeout_s
        orchestrators = await lookup_orchestrators_async(self.dht, self.model_id, timeout_s=timeout_s)
        orchestrators[self.peer_id] = self.record()
        active = active_orchestrator(orchestrators)
        was_active, self.active = self.active, active is not None and active.peer_id == self.peer_id
        if not self.active:
            if was_active:
                log.info("standing by: orchestrator %s is active", active.peer_id if active else None)
            return
        records = await lookup_servers_async(self.dht, self.model_id, timeout_s=timeout_s)
        announced = [record for record in records.values()
                     if self.peer_id in record.orchestrators and record.state != ServerState.draining]
        followers = await self._probe(announced)
        self.followers = followers
        now_s = time.monotonic()
        rate_per_s = self.load.rate_per_s(now_s)
        if self._should_replan(followers, rate_per_s, now_s, became_active=not was_active):
            await self.replan(followers, rate_per_s, now_s)

    async def _probe(self, announced: list[ServerRecord]) -> dict[str, ServerRecord]:
        """Gives the fresh records of the announced followers that answer an `info` call, measuring the RTT on the
        same call (over a stream kept open between rounds: the DHT's copy of a record lags behind a move)."""
        results = await asyncio.gather(*(self._info(record) for record in announced), return_exceptions=True)
        fresh: dict[str, ServerRecord] = {}
        for record, result in zip(announced, results, strict=True):
            if isinstance(result, BaseException):
                misses = self._misses[record.peer_id] = self._misses.get(record.peer_id, 0) + 1
                log.info("server %s did not answer (%d time(s) in a row): %s", record.peer_id, misses, result)
                connection = self._connections.pop(record.peer_id, None)
                if connection is not None:
                    await connection.close()
                if misses < MAX_MISSES and record.peer_id in self.followers:  # one lost answer moves no blocks
                    fresh[record.peer_id] = self.followers[record.peer_id]
                else:
                    self.rtt_ms.pop(record.peer_id, None)
                continue
            self._misses.pop(record.peer_id, None)
            rtt_ms, reply = result
            previous = self.rtt_ms.get(record.peer_id)
            smoothed = rtt_ms if previous is None else 0.7 * previous[0] + 0.3 * rtt_ms
            self.rtt_ms[record.peer_id] = (smoothed, time.monotonic())
            fresh[record.peer_id] = reply
        return fresh

    async def _info(self, record: ServerRecord) -> tuple[float, ServerRecord]:
        connection = self._connections.get(record.peer_id)
        if connection is None or connection.is_closed:
            connection = self._connections[record.peer_id] = await self._dial(record)
            await connection.call("info", {}, timeout=self.config.request_timeout_s)  # the first call warms the stream
        started = time.perf_counter()
        reply = await connection.call("info", {}, timeout=self.config.request_timeout_s)
        rtt_ms = (time.perf_counter() - started) * 1000
        fresh = ServerRecord.from_wire(reply.get("record"))
        if fresh is None or fresh.peer_id != record.peer_id:
            raise MalformedFrame(f"server {record.peer_id} answered `info` with no valid record of itself")
        return rtt_ms, fresh

    async def _dial(self, record: ServerRecord) -> RpcConnection:
        assert self.p2p is not None, "the orchestrator dials servers only once started"
        return await dial(self.p2p, record.peer_id, list(record.addrs), timeout=self.config.request_timeout_s)

    def _should_replan(
        self, followers: dict[str, ServerRecord], rate_per_s: float, now_s: float, *, became_active: bool
    ) -> bool:
        if not followers:
            return False
        if self.plan is None or became_active or set(followers) != self.plan.servers:
            return True
        if any(segment_of(record) != self.plan.ranges[peer] for peer, record in followers.items()
               if peer in self.plan.ranges):
            return True  # a server lost its range (it restarted); a drop keeps its segment (it can restore it)
        moved = abs(rate_per_s - self.plan.rate_per_s) > self.config.rate_hysteresis * self.plan.rate_per_s
        if not moved or now_s - self.plan.installed_s < self.config.rate_window_s:
            return False
        tuned = self._compose(self._model(followers, now_s), rate_per_s)
        return tuned is not None and tuned.c != self.plan.c

    def _model(self, followers: dict[str, ServerRecord], now_s: float) -> SwarmModel:
        rtt = {peer: value for peer, (value, _) in self.rtt_ms.items()}
        jobs, cache_tokens = self.load.jobs(now_s), self.config.cache_tokens
        return swarm_model(followers, rtt, jobs, self.num_blocks, cache_tokens=cache_tokens,
                           batching=self.config.batch_aware)

    def _compose(self, model: SwarmModel, rate_per_s: float) -> TunedPlan | None:
        """Gives the tuned plan for `rate_per_s`; when no c keeps the swarm stable at that rate, the plan of most
        throughput among c = 1, 2, 4, ... (it serves as much as the servers can; powers of two keep this to a few GCA
        runs where c_max is in the thousands); None when no server holds a block and a job's cache."""
        if self.config.variant == "jffc-only":
            try:
                placement, chains = whole_model_chains(model)
            except NoFeasiblePlan as error:
                log.info("jffc-only: %s", error)
                return None
            lower_ms, upper_ms = response_bounds_ms(per_ms(rate_per_s), chains)
            return TunedPlan(max(chain.capacity for chain in chains), placement, tuple(chains), lower_ms, upper_ms)
        spare, method = self.config.variant == "proposed-spare", TUNING[self.config.variant]
        try:
            return tune_capacity(model, per_ms(rate_per_s), self.config.rho_bar, method=method, spare_chains=spare)
        except ValueError as error:
            log.info("tuning c at %.3f jobs/s: %s; planning for the most throughput", rate_per_s, error)
        limit = capacity_limit(model)
        candidates = sorted({*(1 << power for power in range(limit.bit_length())), limit} - {0})
        plans = [plan_for_capacity(model, c, per_ms(rate_per_s), self.config.rho_bar, spare_chains=spare)
                 for c in candidates]
        plans = [plan for plan in plans if plan.chains]
        return max(plans, key=lambda plan: (plan.total_rate_per_ms, -plan.c), default=None)

    async def replan(self, followers: dict[str, ServerRecord], rate_per_s: float, now_s: float) -> None:
        """Composes the swarm anew, moves the servers that must move (in a safe order), and installs the chains."""
        model = self._model(followers, now_s)
        tuned = self._compose(model, rate_per_s)
        if tuned is None:
            log.warning("no plan: no follower holds one block and one job's cache")
            return
        # A server that dropped blocks (KunServe) is placed as the segment it can restore; chains run over what
        # servers serve now.
        current = {peer: segment_of(record) for peer, record in followers.items()
                   if record.block_end > record.block_start}
        hosted = {peer: (record.block_start, record.block_end) for peer, record in followers.items()
                  if record.block_end > record.block_start}
        target = match_roles(placement_ranges(tuned.placement), current, _similar(model))
        order = move_order(current, target, self.num_blocks)
        if order:
            log.info("re-plan (c=%d, %.3f jobs/s): moving %s", tuned.c, rate_per_s,
                     ", ".join(f"{peer}: {current.get(peer)} -> {target[peer]}" for peer in order))
            self.leases.pause()
        actual, planned = dict(hosted), dict(current)
        try:
            for peer in order:
                try:
                    actual[peer] = planned[peer] = await self._assign(followers[peer], target[peer])
                except (SwarmError, OSError) as error:
                    log.warning("server %s did not take blocks %s: %s", peer, target[peer], error)
        finally:
            ranges = {peer: actual[peer] for peer in followers if peer in actual}
            policy_chains = _chains_over(model, ranges)
            chains = tuple(LiveChain.of(chain) for chain in policy_chains)
            lower_ms, upper_ms = response_bounds_ms(per_ms(rate_per_s), policy_chains)
            method = self.config.variant
            if method in TUNING:
                method += f", c by {TUNING[method]}"
            planned = {peer: planned[peer] for peer in followers if peer in planned}
            installed_s = time.monotonic()
            self.plan = LivePlan(tuned.c, method, planned, chains, lower_ms, upper_ms, rate_per_s,
                                 frozenset(followers), installed_s)
            self.leases.install(list(chains), installed_s, batch_slopes(model))
        log.info("plan installed: c=%d, %d chain(s), capacities %s", tuned.c, len(chains),
                 [chain.capacity for chain in chains])

    async def _assign(self, record: ServerRecord, blocks: Range) -> Range:
        connection = await self._dial(record)
        try:
            timeout_s = self.config.block_change_timeout_s
            reply = await connection.call("assign", {"blocks": list(blocks)}, timeout=timeout_s)
        finally:
            await connection.close()
        start, end = reply["blocks"]
        return int(start), int(end)

    # ---- KunServe's drops over the segments followers share ----

    async def _dropping_loop(self) -> None:
        assert self.dropping is not None
        while True:
            started = time.monotonic()
            if self.active and self.followers:
                try:
                    if await self.dropping.tick(self.followers, started):
                        await self._install_current_chains()
                except Exception:  # a failed round must not end the loop: the next one retries
                    log.exception("dropping round failed")
            await asyncio.sleep(max(0.0, self.config.drop_period_s - (time.monotonic() - started)))

    async def _install_current_chains(self) -> None:
        """Re-runs GCA on the ranges the followers serve now (after a drop or a restore) and dispatches over them."""
        if self.plan is None:
            return
        for peer, record in list(self.followers.items()):
            try:
                self.followers[peer] = await self._fresh(record)
            except (SwarmError, OSError) as error:
                log.info("server %s did not answer after a drop or restore: %s", peer, error)
        now_s = time.monotonic()
        model = self._model(self.followers, now_s)
        ranges = {peer: (record.block_start, record.block_end) for peer, record in self.followers.items()
                  if record.block_end > record.block_start}
        policy_chains = _chains_over(model, ranges)
        chains = tuple(LiveChain.of(chain) for chain in policy_chains)
        lower_ms, upper_ms = response_bounds_ms(per_ms(self.plan.rate_per_s), policy_chains)
        self.plan = dataclasses.replace(self.plan, chains=chains, lower_ms=lower_ms, upper_ms=upper_ms)
        self.leases.install(list(chains), now_s, batch_slopes(model))
        log.info("chains over the ranges served now %s: capacities %s", sorted(ranges.items()),
                 [chain.capacity for chain in chains])

    async def _fresh(self, record: ServerRecord) -> ServerRecord:
        return (await self._info(record))[1]

    async def _call(self, record: ServerRecord, method: str, payload: dict[str, object]) -> object:
        connection = await self._dial(record)
        try:
            return await connection.call(method, payload, timeout=self.config.block_change_timeout_s)
        finally:
            await connection.close()

    def _queued_tokens(self) -> int:
        """Gives the KV tokens per block the sessions waiting in JFFC's queue will take (the mean job's each)."""
        return self.leases.queued * self.load.jobs(time.monotonic()).total_tokens

    # ---- KV packing (MELL) over the segments followers share ----

    async def _packing_loop(self) -> None:
        while True:
            started = time.monotonic()
            if self.active:
                try:
                    await self.pack()
                except Exception:  # a failed epoch must not end the loop: the next one retries
                    log.exception("packing epoch failed")
            await asyncio.sleep(max(0.0, self.config.packing_epoch_s - (time.monotonic() - started)))

    async def pack(self) -> None:
        """Runs one packing epoch over every segment that two or more followers host exactly (`--kv-packing`): the
        servers' own loop (`orchestrator.packing.segment_loop`), led by this orchestrator, whose moves keep JFFC's
        leases right: a move runs only if the chain it makes is one of the plan's with a free slot, and the lease
        follows it. The servers the packing makes standbys become JFFC's last resort for new sessions."""
        segments: dict[Range, list[ServerRecord]] = {}
        for record in self.followers.values():
            segments.setdefault((record.block_start, record.block_end), []).append(record)
        self.packings = {segment: loop for segment, loop in self.packings.items()
                         if len(segments.get(segment, [])) >= 2}
        for segment, members in sorted(segments.items()):
            if len(members) < 2:
                continue
            if segment not in self.packings:
                self.packings[segment] = self._segment_packing(segment, members[0].kv_bytes_per_token)
            await self.packings[segment].epoch()
        self.leases.set_standby(peer for loop in self.packings.values() for peer in loop.standby)

    def _segment_packing(self, segment: Range, kv_bytes_per_token: int) -> SegmentPackingLoop:
        async def group() -> list[ServerRecord]:
            return [record for record in self.followers.values()
                    if (record.block_start, record.block_end) == segment]

        assert self.config.kv_packing is not None
        return SegmentPackingLoop(
            self.config.kv_packing, peer_id=self.peer_id, epoch_s=self.config.packing_epoch_s,
            kv_bytes_per_token=lambda blocks: kv_bytes_per_token * blocks, group=group, report=self._kv_report,
            migrate=self._move_session, leads=lambda members: True, allow=self._lease_allows,
        )

    async def _kv_report(self, peer_id: str, accepting: bool) -> Report:
        connection = self._packing_connections.get(peer_id)
        if connection is None or connection.is_closed:
            record = self.followers.get(peer_id)
            if record is None:
                raise PeerUnreachable(f"server {peer_id} no longer follows this orchestrator")
            connection = self._packing_connections[peer_id] = await self._dial(record)
        reply = await connection.call("kv_report", {"accepting": accepting}, timeout=self.config.request_timeout_s)
        report = Report.from_wire(peer_id, reply)
        self._lease_of = {sid: lease for sid, lease in self._lease_of.items() if self.leases.holds(lease)}
        self._lease_of.update(report.leases)
        return report

    def _lease_allows(self, migration: Migration) -> bool:
        lease_id = self._lease_of.get(migration.session_id)
        return lease_id is None or self.leases.can_follow(lease_id, migration.src, migration.dst)

    async def _move_session(self, source: str, session_id: str, destination: str, mode: str) -> None:
        """Moves a session, its lease booked on the chain it goes to before anything awaits (moves of one epoch
        start one after the other, so each sees the slots the ones before it took) and booked back if it fails."""
        lease_id = self._lease_of.get(session_id)
        if lease_id is not None:
            if not self.leases.can_follow(lease_id, source, destination):
                raise ServerBusy(f"moving session {session_id} to {destination} would put it on no chain of the "
                                 f"plan with a free slot")
            self.leases.follow(lease_id, source, destination, time.monotonic())
        try:
            record = self.followers.get(source)
            if record is None:
                raise PeerUnreachable(f"server {source} no longer follows this orchestrator")
            connection = await self._dial(record)
            try:
                await connection.call("migrate", {"session_id": session_id, "peer_id": destination, "mode": mode},
                                      timeout=self.config.block_change_timeout_s)
            finally:
                await connection.close()
        except BaseException:
            if lease_id is not None:
                self.leases.follow(lease_id, destination, source, time.monotonic())
            raise

    # ---- RPC methods ----

    def _check_active(self) -> None:
        if not self.active:
            raise NotActiveOrchestrator(f"orchestrator {self.peer_id} stands by; ask the active one of the model")

    async def _acquire(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """Gives a lease on a chain by JFFC, at once or after waiting in the queue (at most `wait_s`)."""
        self._check_active()
        prompt_tokens = payload.get("prompt_tokens", 0)
        wait_s = payload.get("wait_s", MAX_WAIT_S)
        if not isinstance(prompt_tokens, int) or isinstance(prompt_tokens, bool) or prompt_tokens < 0:
            raise MalformedFrame(f"'prompt_tokens' must be a non-negative integer, got {prompt_tokens!r:.50}")
        if not isinstance(wait_s, int | float) or isinstance(wait_s, bool) or not 0 <= wait_s <= MAX_WAIT_S:
            raise MalformedFrame(f"'wait_s' must be a number in 0..{MAX_WAIT_S}, got {wait_s!r:.50}")
        if not self.leases.chains and not self.leases.paused:
            raise NoRouteFound(f"orchestrator {self.peer_id} has no chain through every block yet")
        now_s = time.monotonic()
        self.load.arrive(now_s)
        job_id, started = self.leases.request(prompt_tokens, now_s)
        ctx.add_close_callback(lambda: self.leases.withdraw(job_id))
        try:
            lease = await asyncio.wait_for(asyncio.shield(started), wait_s)
        except TimeoutError:
            self.leases.withdraw(job_id)
            raise ServerBusy(f"every chain stayed full for {wait_s} s; {self.leases.queued} session(s) wait") from None
        spans = [{**span.to_wire(), "record": self.followers[span.peer_id].to_wire()}
                 if span.peer_id in self.followers else span.to_wire() for span in lease.chain.spans]
        return {"lease_id": lease.lease_id, "spans": spans,
                "lease_ttl_s": self.config.lease_ttl_s, "waited_ms": (time.monotonic() - now_s) * 1000}

    async def _renew(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        lease_id = payload.get("lease_id")
        if not isinstance(lease_id, str):
            raise MalformedFrame("'lease_id' must be a string")
        self.leases.renew(lease_id, time.monotonic())
        return {"lease_ttl_s": self.config.lease_ttl_s}

    async def _release(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        lease_id, tokens = payload.get("lease_id"), payload.get("tokens", 0)
        if not isinstance(lease_id, str) or not isinstance(tokens, int) or isinstance(tokens, bool):
            raise MalformedFrame("'lease_id' must be a string and 'tokens' an integer")
        now_s = time.monotonic()
        lease = self.leases.release(lease_id, now_s)
        self.load.end(now_s, prompt_tokens=lease.prompt_tokens, output_tokens=tokens - lease.prompt_tokens)
        return {}

    def _server_view(self, record: ServerRecord, jobs: JobSizes) -> dict[str, float | None]:
        spec = server_spec(record, self.rtt_ms.get(record.peer_id, (0.0, 0))[0], jobs)
        return {"rtt_ms": self.rtt_ms.get(record.peer_id, (None, 0))[0], "tau_p_ms": spec.tau_p_ms,
                "tau_p_batch_ms": spec.tau_p_batch_ms}

    async def _plan(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """Gives the live state: c, method, blocks, chains, arrival rate, queue, sessions dispatched, bounds."""
        return self.state()

    def state(self) -> dict[str, Any]:
        """Gives what `swarm-orchestrator plan` prints (JSON-safe)."""
        plan, now_s = self.plan, time.monotonic()

        def finite(value: float) -> float | None:
            return value if math.isfinite(value) else None

        chains = [] if plan is None else [
            {"servers": [span.peer_id for span in chain.spans], "blocks": [[s.start, s.end] for s in chain.spans],
             "capacity": chain.capacity, "in_use": self.leases.in_use(index),
             "service_time_ms": chain.service_time_ms, "service_time_now_ms": self.leases.service_time_ms(index)}
            for index, chain in enumerate(plan.chains)
        ]
        jobs = self.load.jobs(now_s)
        return {
            "orchestrator": self.peer_id, "active": self.active, "model": self.model_id,
            "c": None if plan is None else plan.c, "method": None if plan is None else plan.method,
            "blocks": {} if plan is None else {peer: list(span) for peer, span in sorted(plan.ranges.items())},
            "chains": chains, "arrival_rate": self.load.rate_per_s(now_s), "queued": self.leases.queued,
            "dispatched": self.leases.dispatched, "leases": self.leases.leases,
            "bounds": {"lower_ms": None if plan is None else finite(plan.lower_ms),
                       "upper_ms": None if plan is None else finite(plan.upper_ms)},
            "jobs": {"prompt_tokens": jobs.prompt_tokens, "output_tokens": jobs.output_tokens},
            "packing": {f"{start}:{end}": loop.to_wire() for (start, end), loop in sorted(self.packings.items())},
            "dropping": self.dropping.to_wire() if self.dropping is not None else None,
            "servers": {peer: self._server_view(record, jobs) for peer, record in sorted(self.followers.items())},
        }
