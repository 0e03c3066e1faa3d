"""The swarm as it is now, for the live page and `GET /api/v1/swarm`: servers, coverage, chains, recent events.

`SwarmWatcher` reads the DHT every `period_s` in the background (every server's record of the model, any state, and
the active orchestrator's `info` if one runs) and keeps the latest view. Events are what changed between two reads:
a server that joined or left, dropped blocks or restored them (KunServe), and sessions that moved in by migration
(MELL's packing, a drain, a drop's exchange); the last `HISTORY` of them are kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from client.swarm_client import SwarmClient
from swarm.dht import lookup_orchestrators_async, lookup_servers_async
from swarm.errors import SwarmError
from swarm.records import ServerRecord, ServerState, active_orchestrator
from swarm.rpc import dial

log = logging.getLogger(__name__)

HISTORY = 50
READ_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class SwarmEvent:
    """One change seen between two reads of the swarm."""

    at: float  # unix time
    kind: str  # joined, left, blocks (its range changed), dropped, restored, moved_in
    peer_id: str
    name: str
    detail: str


def throughput(record: ServerRecord) -> float | None:
    """Gives the tokens per second one sequence decodes through the server's blocks, from its measured block time."""
    blocks = record.block_end - record.block_start
    if blocks == 0 or record.block_compute_ms <= 0:
        return None
    return 1000.0 / (record.block_compute_ms * blocks)


def server_view(record: ServerRecord) -> dict[str, Any]:
    restorable = (None if record.restorable_start is None
                  else [record.restorable_start, record.restorable_end])
    return {"peer_id": record.peer_id, "public_name": record.public_name,
            "blocks": [record.block_start, record.block_end], "state": record.state.value,
            "pages_total": record.pages_total, "pages_free": record.pages_free, "pages_kv": record.pages_kv,
            "sessions": record.session_count, "throughput": throughput(record), "accepting": record.accepting,
            "restorable": restorable, "reshaping": record.reshaping, "dtype": record.dtype, "quant": record.quant,
            "version": record.version}


def coverage(records: dict[str, ServerRecord], num_blocks: int) -> list[int]:
    """Gives, per block, how many online servers host it."""
    online = [record for record in records.values() if record.state == ServerState.online]
    return [sum(block in record.block_range for record in online) for block in range(num_blocks)]


def changes(old: dict[str, ServerRecord], new: dict[str, ServerRecord], at: float) -> list[SwarmEvent]:
    """Gives the events between two reads of the swarm's records."""
    events = []

    def event(kind: str, record: ServerRecord, detail: str) -> None:
        events.append(SwarmEvent(at, kind, record.peer_id, record.public_name or record.peer_id[-8:], detail))

    for peer, record in new.items():
        before = old.get(peer)
        span = f"{record.block_start}:{record.block_end}"
        if before is None:
            event("joined", record, f"blocks {span}" if record.block_end > record.block_start else "waiting for blocks")
            continue
        moved = f"blocks {before.block_start}:{before.block_end} -> {span}"
        if record.drops > before.drops:
            event("dropped", record, moved)
        if record.restores > before.restores:
            event("restored", record, moved)
        if (record.drops, record.restores) == (before.drops, before.restores) and (
                record.block_start, record.block_end) != (before.block_start, before.block_end):
            event("blocks", record, moved)  # assigned by its orchestrator, or chosen (a rebalance)
        if record.moved_in > before.moved_in:
            event("moved_in", record, f"{record.moved_in - before.moved_in} session(s) arrived")
        if record.state != before.state and record.state == ServerState.draining:
            event("left", record, "draining")
    for peer, record in old.items():
        if peer not in new and record.state != ServerState.draining:
            event("left", record, "its record expired")
    return events


class SwarmWatcher:
    """Reads the swarm every `period_s` and keeps the latest view (see the module's docstring)."""

    def __init__(self, swarm: SwarmClient, model_name: str, *, period_s: float = 2.0) -> None:
        self.swarm, self.model_name, self.period_s = swarm, model_name, period_s
        self.records: dict[str, ServerRecord] = {}
        self.orchestrator: dict[str, Any] | None = None
        self.events: deque[SwarmEvent] = deque(maxlen=HISTORY)
        self.updated_at: float | None = None
        self.error: str | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="swarm-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def refresh(self) -> None:
        """Reads the swarm once now."""
        records, orchestrator = await asyncio.to_thread(self.swarm.run, self._read(), timeout=3 * READ_TIMEOUT_S)
        now = time.time()
        if self.updated_at is not None:
            self.events.extend(changes(self.records, records, now))
        self.records, self.orchestrator, self.updated_at, self.error = records, orchestrator, now, None

    async def _watch(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as error:  # a DHT hiccup: the page shows the last view and the error
                self.error = f"{type(error).__name__}: {error}"
                log.info("reading the swarm failed: %s", self.error)
            await asyncio.sleep(self.period_s)

    async def _read(self) -> tuple[dict[str, ServerRecord], dict[str, Any] | None]:
        swarm = self.swarm
        records = await lookup_servers_async(swarm.dht, swarm.model_id, timeout_s=READ_TIMEOUT_S)
        found = await lookup_orchestrators_async(swarm.dht, swarm.model_id, timeout_s=READ_TIMEOUT_S)
        active = active_orchestrator(found)
        if active is None:
            return records, None
        try:
            connection = await dial(swarm.p2p, active.peer_id, list(active.addrs), timeout=READ_TIMEOUT_S)
            try:
                return records, await connection.call("info", {}, timeout=READ_TIMEOUT_S)
            finally:
                await connection.close()
        except (SwarmError, OSError, TimeoutError) as error:
            log.info("orchestrator %s did not answer: %s", active.peer_id, error)
            return records, {"orchestrator": active.peer_id, "error": str(error)}

    def view(self) -> dict[str, Any]:
        """Gives the JSON of `GET /api/v1/swarm`."""
        num_blocks = self.swarm.num_blocks
        servers = sorted(self.records.values(), key=lambda record: (record.block_start, record.block_end,
                                                                    record.peer_id))
        orchestrator = self.orchestrator
        chains = None
        if orchestrator is not None and "chains" in orchestrator:
            chains = [{"servers": chain["servers"], "blocks": chain["blocks"], "capacity": chain["capacity"],
                       "in_use": chain["in_use"]} for chain in orchestrator["chains"]]
        return {
            "model": self.model_name, "model_id": self.swarm.model_id, "num_blocks": num_blocks,
            "servers": [server_view(record) for record in servers],
            "coverage": coverage(self.records, num_blocks),
            "chains": chains,
            "orchestrator": None if orchestrator is None else {
                "peer_id": orchestrator.get("orchestrator"), "queued": orchestrator.get("queued"),
                "dispatched": orchestrator.get("dispatched"), "error": orchestrator.get("error")},
            "events": [asdict(event) for event in reversed(self.events)],
            "updated_at": self.updated_at, "error": self.error,
        }
