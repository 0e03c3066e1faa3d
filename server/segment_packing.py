"""MELL's epoch loop run by the servers of one segment themselves, without an orchestrator (`--kv-packing`).

The servers that announce the same blocks form a group; its leader is the one with the smallest peer id among those
online (every member computes the same from the DHT, so no election is needed). Every `--packing-epoch` the leader:
1. asks each member for its sessions (`kv_report`: id, KV pages, tokens) and its KV capacity, telling it at the same
   time whether to take new sessions (the previous epoch's `accepting`; a member the leader stops calling goes back
   to accepting after three epochs);
2. runs the packer over the group (`orchestrator.packing.SegmentPacking`, the same code the simulator drives);
3. splits the migrations into KV transfers and replays within the epoch's budgets (`split_migrations`: half an
   epoch of each link's measured bandwidth, half an epoch of each destination's prefill; a move too large for one
   epoch either way takes the mode `choose_mode` picks for it alone) and asks each source to `migrate` (a source
   takes that request from its segment's leader, as from the session's client);
4. deferred moves and moves still running are left to the next epoch.
Members check a caller's claim to lead against their own view of the DHT.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.live_model import prefill_ms_per_token
from orchestrator.packing import (
    BestFitPacker,
    LoadBalancePacker,
    MellPacker,
    Migration,
    MigrationCosts,
    Packer,
    ReportedSession,
    SegmentPacking,
    WorstFitPacker,
    choose_mode,
    split_migrations,
)
from server.migration import announced_bytes_per_s, move_costs
from swarm.errors import SwarmError
from swarm.records import ServerRecord, ServerState

log = logging.getLogger(__name__)

PACKERS: dict[str, Callable[[Sequence[str], int], Packer]] = {
    "mell": MellPacker, "bf": BestFitPacker, "wf": WorstFitPacker, "lb": LoadBalancePacker,
}
ORPHAN_EPOCHS = 3  # epochs without word from a leader after which a standby takes sessions again


@dataclass(frozen=True)
class Report:
    """What one member told the leader: its KV capacity in pages and its sessions."""

    capacity_pages: int
    sessions: list[ReportedSession]


def leader_of(records: Sequence[ServerRecord]) -> str | None:
    """Gives the peer id that leads a group of servers (the smallest of those online), None for an empty group."""
    online = sorted(record.peer_id for record in records if record.state == ServerState.online)
    return online[0] if online else None


def group_of(records: dict[str, ServerRecord], start: int, end: int) -> list[ServerRecord]:
    """Gives the online servers that host exactly blocks [start, end)."""
    return [record for record in records.values()
            if (record.block_start, record.block_end) == (start, end) and record.state == ServerState.online]


class SegmentPackingLoop:
    """The leader's side of one segment's packing, epoch by epoch; members answer `kv_report` and `migrate`."""

    def __init__(
        self,
        policy: str,
        *,
        peer_id: str,
        epoch_s: float,
        kv_bytes_per_token: Callable[[int], int],
        group: Callable[[], Awaitable[list[ServerRecord]]],
        report: Callable[[str, bool], Awaitable[Report]],
        migrate: Callable[[str, str, str, str], Awaitable[None]],
    ) -> None:
        self.policy, self.peer_id, self.epoch_s = policy, peer_id, epoch_s
        self._kv_bytes_per_token = kv_bytes_per_token  # of a session over `blocks` blocks, per token
        self._group, self._report, self._migrate = group, report, migrate
        self._packing: SegmentPacking | None = None
        self._segment: tuple[int, int] | None = None
        self._accepting: dict[str, bool] = {}
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self.epochs = 0
        self.moves = {"kv": 0, "replay": 0, "failed": 0, "deferred": 0}

    async def run(self) -> None:
        """Runs epochs until cancelled."""
        while True:
            started = time.monotonic()
            try:
                await self.epoch()
            except SwarmError as error:
                log.info("packing epoch skipped: %s: %s", type(error).__name__, error.message)
            await asyncio.sleep(max(0.0, self.epoch_s - (time.monotonic() - started)))

    async def epoch(self) -> None:
        """One epoch, if this server leads its group (see the module docstring)."""
        members = await self._group()
        if leader_of(members) != self.peer_id or len(members) < 2:
            self._packing = None
            return
        segment = (members[0].block_start, members[0].block_end)
        if self._packing is None or segment != self._segment:
            blocks = segment[1] - segment[0]
            self._packing = SegmentPacking(PACKERS[self.policy], self._kv_bytes_per_token(blocks))
            self._segment, self._accepting = segment, {}
        by_peer = {record.peer_id: record for record in members}
        replies = await asyncio.gather(*(self._report(peer, self._accepting.get(peer, True)) for peer in by_peer),
                                       return_exceptions=True)
        reports = {peer: reply for peer, reply in zip(by_peer, replies, strict=True) if isinstance(reply, Report)}
        self._in_flight = {sid: task for sid, task in self._in_flight.items() if not task.done()}
        plan = self._packing.epoch({peer: report.capacity_pages for peer, report in reports.items()},
                                   [session for report in reports.values() for session in report.sessions],
                                   in_flight=self._in_flight)
        self._accepting = plan.accepting
        self.epochs += 1
        kv, replay, deferred = self._split(plan.migrations, by_peer)
        self.moves["deferred"] += len(deferred)
        for migration, mode in [(m, "kv") for m in kv] + [(m, "replay") for m in replay]:
            self._in_flight[migration.session_id] = asyncio.create_task(self._move(migration, mode))

    def _split(self, migrations: list[Migration], records: dict[str, ServerRecord]
               ) -> tuple[list[Migration], list[Migration], list[Migration]]:
        """Splits the epoch's migrations by the spec's budgets; a move too large for any one epoch goes alone, in
        the mode `choose_mode` picks for it."""
        links: dict[tuple[str, str], float] = {}
        replays: dict[str, float] = {}
        costs: dict[tuple[str, str], MigrationCosts] = {}
        for migration in migrations:
            link = (migration.src, migration.dst)
            costs[link] = cost = self._costs(records[migration.src], records[migration.dst])
            links[link] = cost.link_budget_bytes
            replays[migration.dst] = cost.replay_budget_tokens
        kv, replay, deferred = split_migrations(migrations, links, replays)
        waiting = []
        for migration in deferred:
            cost = costs[(migration.src, migration.dst)]
            if migration.kv_bytes > cost.link_budget_bytes and migration.replay_tokens > cost.replay_budget_tokens:
                (kv if choose_mode(cost, migration.replay_tokens) == "kv" else replay).append(migration)
            else:
                waiting.append(migration)
        return kv, replay, waiting

    def _costs(self, source: ServerRecord, destination: ServerRecord) -> MigrationCosts:
        """Gives a move's costs as a source prices its own (`move_costs`), from the two records alone: the leader
        measures no RTT between members, nor the client's upload of a replay."""
        blocks = destination.block_end - destination.block_start
        return move_costs(
            kv_bytes_per_token=self._kv_bytes_per_token(blocks),
            bandwidth_bytes_per_s=announced_bytes_per_s(source.network_mbps, destination.network_mbps), rtt_s=0.0,
            prefill_s_per_token=prefill_ms_per_token(destination) * blocks / 1000, replay_bytes_per_token=0,
            epoch_s=self.epoch_s,
        )

    async def _move(self, migration: Migration, mode: str) -> None:
        try:
            await self._migrate(migration.src, migration.session_id, migration.dst, mode)
            self.moves[mode] += 1
        except SwarmError as error:
            self.moves["failed"] += 1
            log.info("packing: moving session %s from %s to %s failed: %s: %s", migration.session_id,
                     migration.src, migration.dst, type(error).__name__, error.message)

    def to_wire(self) -> dict[str, Any]:
        return {"policy": self.policy, "epochs": self.epochs, "moves": dict(self.moves),
                "accepting": dict(self._accepting)}
