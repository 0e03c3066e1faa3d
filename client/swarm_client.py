"""The client's view of the swarm: a client-mode DHT node, server records, measured RTTs and RPC connections."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from hivemind.p2p import P2P

from client.chain_lease import ChainLease
from client.loop import BackgroundLoop
from client.routing import DEFAULT_RTT_MS, Span, find_route, servers_of
from client.step_frames import StepFrames
from swarm.dht import lookup_async, lookup_orchestrators_async
from swarm.errors import ServerBusy, SwarmError
from swarm.records import OrchestratorRecord, ServerRecord, active_orchestrator
from swarm.rpc import RpcConnection, dial
from swarm.signing import open_dht

log = logging.getLogger(__name__)


@dataclass
class ClientConfig:
    """Timeouts and routing knobs of a swarm client."""

    connect_timeout_s: float = 10.0
    request_timeout_s: float = 60.0
    lookup_timeout_s: float = 15.0
    rtt_ttl_s: float = 60.0
    ban_s: float = 30.0
    max_failovers: int = 8
    busy_wait_s: float = 60.0  # how long a session waits for room while every server that could serve it is busy
    records_max_age_s: float = 1.0  # a new session may route on DHT records looked up this long ago (by any session)
    route_wait_s: float = 30.0  # how long a session waits for blocks that no online server covers (restarting ones)
    max_frame_bytes: int = 64 << 20
    compression: str | None = None
    server_push: bool = True  # servers forward hidden states to the next server (the client's copy follows)
    orchestrator: str | None = "auto"  # "auto": the model's active orchestrator if one is announced; None: never
    # ask one (route by DHT records); a peer id: that orchestrator only
    orchestrator_timeout_s: float = 5.0  # to find and reach the orchestrator; past it, the client routes by itself
    orchestrator_queue_timeout_s: float = 600.0  # how long a session may wait in the orchestrator's queue
    orchestrator_lookup_s: float = 10.0  # how long the orchestrator found in the DHT is asked before looking again
    verify_fraction: float = 0.0  # share of steps whose every span a second server recomputes (`client.verification`)
    verify_seed: int | None = None  # seeds which steps are checked and by whom (None: unpredictable to servers)
    cheat_ban_s: float = 3600.0  # how long a server caught returning wrong outputs is avoided


class SwarmClient:
    """Finds servers of one model on the DHT and opens connections to them."""

    def __init__(
        self, model_id: str, num_blocks: int, initial_peers: list[str], config: ClientConfig | None = None
    ) -> None:
        self.model_id, self.num_blocks = model_id, num_blocks
        self.config = config or ClientConfig()
        self.background = BackgroundLoop()
        # it stores nothing, and keeps only the records their servers signed (`swarm.signing`)
        self.dht = open_dht(sign=False, initial_peers=initial_peers, client_mode=True)
        self.p2p: P2P = self.background.run(self.dht.replicate_p2p(), timeout=30)
        self._rtt_ms: dict[str, tuple[float, float]] = {}  # peer -> (rtt, measured at)
        self._banned_until: dict[str, float] = {}
        self.step_frames = StepFrames()  # decode steps of this client's sessions, one frame per server
        self._orchestrator: tuple[OrchestratorRecord | None, float] | None = None  # (record, looked up at)
        self._servers: tuple[dict[str, ServerRecord], float] | None = None  # the last lookup, and when it began
        self._withdrawals: set[asyncio.Task[None]] = set()  # waits being withdrawn from servers (`withdraw_wait`)

    def run(self, coroutine, timeout: float | None = None):  # type: ignore[no-untyped-def]
        """Runs a coroutine on the client's loop and gives its result."""
        return self.background.run(coroutine, timeout)

    async def servers(self) -> dict[str, ServerRecord]:
        """Gives the online servers of the model found on the DHT now."""
        started = time.monotonic()
        records = await lookup_async(self.dht, self.model_id, self.num_blocks, timeout_s=self.config.lookup_timeout_s)
        servers = servers_of(records)
        if self._servers is None or self._servers[1] <= started:
            self._servers = (servers, started)
        return dict(servers)

    def known_record(self, peer_id: str) -> ServerRecord | None:
        """Gives `peer_id`'s record from the latest lookup, whatever its age (None if it had none). Enough to dial the
        server: its addresses outlive the block ranges its record announces, which a drop or restore changes."""
        return self._servers[0].get(peer_id) if self._servers is not None else None

    def recent_servers(self, max_age_s: float) -> dict[str, ServerRecord] | None:
        """Gives the servers of the latest lookup if it began at most `max_age_s` ago, else None. Servers announce
        their records every few seconds, so a lookup a moment old is about as fresh as one now, and costs nothing:
        a lookup takes several round trips to the DHT."""
        if self._servers is None or time.monotonic() - self._servers[1] > max_age_s:
            return None
        return dict(self._servers[0])

    def note_hosted(self, peer_id: str, hosted: tuple[int, int], servers: dict[str, ServerRecord]) -> bool:
        """A server answered that it takes new sessions on blocks `hosted` now (`BlocksNotHosted.hosted`), which its
        record in `servers` (a round's records) does not say: gives whether that record changed, there and in the
        latest lookup's records, so that routes go on at once with the range the server serves (its record in the
        DHT shows it only once its next announce has spread)."""
        record = servers.get(peer_id)
        start, end = hosted
        if record is None or (record.block_start, record.block_end) == hosted or end > self.num_blocks:
            return False
        servers[peer_id] = record.model_copy(update={"block_start": start, "block_end": end})
        if self._servers is not None and peer_id in self._servers[0]:
            self._servers[0][peer_id] = servers[peer_id]
        return True

    def ban(self, peer_id: str, seconds: float | None = None) -> None:
        """Avoids `peer_id` in routes for `seconds` (default `ban_s`: it failed us), or longer if already banned."""
        until = time.monotonic() + (self.config.ban_s if seconds is None else seconds)
        self._banned_until[peer_id] = max(until, self._banned_until.get(peer_id, 0.0))
        self._rtt_ms.pop(peer_id, None)

    def banned(self) -> set[str]:
        now = time.monotonic()
        return {peer for peer, until in self._banned_until.items() if until > now}

    async def connect(self, record: ServerRecord) -> RpcConnection:
        """Gives a new RPC stream to the server of `record`, dialing its announced addresses first."""
        return await dial(
            self.p2p, record.peer_id, list(record.addrs), timeout=self.config.connect_timeout_s,
            max_frame_bytes=self.config.max_frame_bytes,
        )

    def rtt_ms(self, peer_id: str) -> float:
        """Gives the latest measured round trip to `peer_id` in ms (a default guess if never measured)."""
        measured = self._rtt_ms.get(peer_id)
        return measured[0] if measured is not None else DEFAULT_RTT_MS

    async def measure_rtt(self, record: ServerRecord) -> float:
        """Gives the round trip of an `info` call to the server in ms (cached for `rtt_ttl_s`)."""
        cached = self._rtt_ms.get(record.peer_id)
        if cached is not None and time.monotonic() - cached[1] < self.config.rtt_ttl_s:
            return cached[0]
        connection = await self.connect(record)
        try:
            await connection.call("info", {}, timeout=self.config.connect_timeout_s)  # first call warms the stream
            started = time.perf_counter()
            await connection.call("info", {}, timeout=self.config.connect_timeout_s)
            rtt_ms = (time.perf_counter() - started) * 1000
        finally:
            await connection.close()
        self._rtt_ms[record.peer_id] = (rtt_ms, time.monotonic())
        return rtt_ms

    async def route(self, start: int, end: int, *, max_length: int, batch: int = 1,
                    avoid: Collection[str] = (), servers: Mapping[str, ServerRecord] | None = None) -> list[Span]:
        """Gives the min-latency chain for blocks [start, end), measuring RTTs of servers not measured recently;
        the servers in `avoid` are left out, as banned ones are. `servers`: the records to route on (default: looked
        up on the DHT now)."""
        if servers is None:
            servers = await self.servers()
        banned = self.banned() | set(avoid)
        candidates = [record for peer, record in sorted(servers.items()) if peer not in banned]
        results = await asyncio.gather(*(self.measure_rtt(r) for r in candidates), return_exceptions=True)
        rtt_ms: dict[str, float] = {}
        for record, result in zip(candidates, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, SwarmError | OSError | asyncio.TimeoutError):
                    raise result
                log.info("Server %s did not answer a ping (%s); avoiding it", record.peer_id, result)
                self.ban(record.peer_id)
            else:
                rtt_ms[record.peer_id] = result
        return find_route(servers, start, end, rtt_ms=rtt_ms, max_length=max_length, batch=batch,
                          banned=self.banned() | set(avoid))

    async def _orchestrator_record(self) -> OrchestratorRecord | None:
        """Gives the orchestrator this client asks (the model's active one, or the one named), looked up in the DHT at
        most every `orchestrator_lookup_s` seconds: sessions that start together share one lookup."""
        now = time.monotonic()
        if self._orchestrator is not None and now - self._orchestrator[1] < self.config.orchestrator_lookup_s:
            return self._orchestrator[0]
        records = await lookup_orchestrators_async(
            self.dht, self.model_id, timeout_s=self.config.orchestrator_timeout_s
        )
        choice = self.config.orchestrator
        record = active_orchestrator(records) if choice == "auto" else records.get(str(choice))
        self._orchestrator = (record, now)
        return record

    async def acquire_chain(self, *, prompt_tokens: int) -> ChainLease | None:
        """Gives a chain leased from the orchestrator (waiting in its queue while every chain is full), or None when
        this client uses none or cannot reach it within `orchestrator_timeout_s` (it then routes by itself). Raises
        ServerBusy when every chain stayed full for `orchestrator_queue_timeout_s`."""
        config = self.config
        if config.orchestrator is None:
            return None
        timeout_s = config.orchestrator_timeout_s
        try:
            record = await self._orchestrator_record()
            if record is None:
                return None
            connection = await dial(self.p2p, record.peer_id, list(record.addrs), timeout=timeout_s)
        except (SwarmError, OSError, TimeoutError) as error:
            log.info("No orchestrator reachable (%s); routing by DHT records", error)
            self._orchestrator = None
            return None
        try:
            payload = {"prompt_tokens": prompt_tokens, "wait_s": config.orchestrator_queue_timeout_s}
            reply = await connection.call("acquire", payload, timeout=config.orchestrator_queue_timeout_s + timeout_s)
            spans = ChainLease.spans_from_wire(reply.get("spans"))
            lease = ChainLease(connection, str(reply["lease_id"]), spans, ttl_s=float(reply["lease_ttl_s"]),
                               timeout_s=timeout_s)
        except ServerBusy:  # it queued the session for `orchestrator_queue_timeout_s` and no chain freed up: routing
            await connection.close()  # around its queue would overfill the chains JFFC keeps within capacity
            raise
        except (SwarmError, OSError, TimeoutError, KeyError, TypeError, ValueError) as error:
            log.info("The orchestrator gave no chain (%s: %s); routing by DHT records", type(error).__name__, error)
            await connection.close()
            return None
        if spans[-1].end != self.num_blocks:
            log.info("The orchestrator's chain ends at block %d of %d; routing by DHT records", spans[-1].end,
                     self.num_blocks)
            await lease.release(0)
            return None
        return lease

    def withdraw_wait(self, record: ServerRecord, wait_key: str) -> None:
        """Tells the server of `record`, in the background, that the wait it refused as `wait_key` opened elsewhere,
        so that it no longer stands in its line: the server would otherwise count it, and keep the room it named to
        it, until the wait's refusals are `server.sessions.REFUSED_WINDOW_S` old. Must run on the client's loop."""
        task = asyncio.get_running_loop().create_task(self._withdraw(record, wait_key), name="withdraw-wait")
        self._withdrawals.add(task)
        task.add_done_callback(self._withdrawals.discard)

    async def _withdraw(self, record: ServerRecord, wait_key: str) -> None:
        try:
            connection = await self.connect(record)
            try:
                await connection.call("withdraw", {"wait_id": wait_key}, timeout=self.config.connect_timeout_s)
            finally:
                await connection.close()
        except (SwarmError, OSError, TimeoutError) as error:  # a courtesy: the server forgets the wait in time anyway
            log.debug("Could not withdraw a wait from %s: %s", record.peer_id, error)

    def shutdown(self) -> None:
        """Leaves the DHT and stops the background loop."""
        try:
            self.background.run(self.p2p.shutdown(), timeout=10)
        except Exception:  # the daemon may already be gone
            log.debug("p2p shutdown failed", exc_info=True)
        self.dht.shutdown()
        self.background.stop()
