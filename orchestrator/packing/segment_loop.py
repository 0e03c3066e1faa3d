"""MELL's epoch loop over the servers of one segment, as its leader runs it: one of those servers, without an
orchestrator (`swarm-server --kv-packing`), or the orchestrator they follow (`swarm-orchestrator --kv-packing`). It
does no I/O of its own: the caller gives it the group, the members' reports and the moves as callables.

The servers that announce the same blocks form a group; its leader is the one with the smallest peer id among those
online (every member computes the same from the DHT, so no election is needed). Every `--packing-epoch` the leader:
1. asks each member for its sessions (`kv_report`: id, KV pages, tokens), its KV capacity (`packing_capacity`:
   its KV pages less a reserve for growth between epochs) and the bandwidth its KV transfers to the other members
   achieved, telling it at the same
   time whether to take new sessions (the previous epoch's `accepting`; a member the leader stops calling goes back
   to accepting after three epochs);
2. runs the packer over the group (`orchestrator.packing.SegmentPacking`, the same code the simulator drives);
3. splits the migrations into KV transfers and replays within the epoch's budgets (`split_migrations`: half an
   epoch of each link's bandwidth (as its source measured it, else as the records announce it), half an epoch of
   each destination's prefill; a move too large for one
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
from dataclasses import dataclass, field
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
from orchestrator.packing.migration_split import announced_bytes_per_s, move_costs
from swarm.errors import MalformedFrame, SwarmError
from swarm.records import ServerRecord, ServerState

log = logging.getLogger(__name__)

PACKERS: dict[str, Callable[[Sequence[str], int], Packer]] = {
    "mell": MellPacker, "bf": BestFitPacker, "wf": WorstFitPacker, "lb": LoadBalancePacker,
}
ORPHAN_EPOCHS = 3  # epochs without word from a leader after which a standby takes sessions again
ARRIVAL_EPOCHS = 5  # epochs a session moved by replay may be on no server before the packing lets it go
RESERVE_PAGES_PER_BLOCK = 1  # KV pages per hosted block a member keeps out of the packing's C


def packing_capacity(kv_pages: int, blocks: int) -> int:
    """Gives the C a member reports: its KV pages less a reserve of one page per hosted block (spec 5.1), so that
    the sessions the packer fills it with can still grow until the next epoch's Update moves one away."""
    return max(0, kv_pages - RESERVE_PAGES_PER_BLOCK * blocks)


@dataclass(frozen=True)
class Report:
    """What one member told the leader: its KV capacity in pages, its sessions, and the bandwidth its KV transfers
    to other members achieved (bytes/s, by peer id)."""

    capacity_pages: int
    sessions: list[ReportedSession]
    links: dict[str, float] = field(default_factory=dict)
    leases: dict[str, str] = field(default_factory=dict)  # session -> the orchestrator's lease it runs under

    @staticmethod
    def from_wire(peer_id: str, reply: dict[str, Any]) -> Report:
        """Gives member `peer_id`'s report from its `kv_report` reply; raises MalformedFrame if it is not one."""
        try:
            sessions = [ReportedSession(str(item["session_id"]), peer_id, int(item["pages"]), int(item["tokens"]),
                                        bool(item.get("settling", False))) for item in reply["sessions"]]
            links = {str(peer): float(rate) for peer, rate in dict(reply.get("links") or {}).items()
                     if float(rate) > 0}
            leases = {str(item["session_id"]): str(item["lease_id"]) for item in reply["sessions"]
                      if item.get("lease_id")}
            return Report(int(reply["capacity_pages"]), sessions, links, leases)
        except (KeyError, TypeError, ValueError) as error:
            raise MalformedFrame(f"member {peer_id} sent a malformed kv_report: {error!r:.200}") from None


def leader_of(records: Sequence[ServerRecord]) -> str | None:
    """Gives the peer id that leads a group of servers (the smallest of those online), None for an empty group."""
    online = sorted(record.peer_id for record in records if record.state == ServerState.online)
    return online[0] if online else None


def group_of(records: dict[str, ServerRecord], start: int, end: int) -> list[ServerRecord]:
    """Gives the online servers that host exactly blocks [start, end)."""
    return [record for record in records.values()
            if (record.block_start, record.block_end) == (start, end) and record.state == ServerState.online]


@dataclass
class _Moving:
    """A move the leader asked for: until its source answers, and after a replay until the session shows up at its
    destination (its client opens it there at its next step; meanwhile no member reports it), for at most
    ARRIVAL_EPOCHS."""

    task: asyncio.Task[bool]
    destination: str
    replay: bool
    epoch: int

    def going(self, reported: bool, epoch: int) -> bool:
        """Gives whether the move still runs, or its session is still on its way by replay."""
        if not self.task.done():
            return True
        handed_over = self.replay and not self.task.cancelled() and self.task.exception() is None and self.task.result()
        return handed_over and not reported and epoch - self.epoch < ARRIVAL_EPOCHS


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
        leads: Callable[[list[ServerRecord]], bool] | None = None,
        allow: Callable[[Migration], bool] | None = None,
    ) -> None:
        """`leads(members)`: whether this runs the group's packing (default: when `peer_id` leads it, see
        `leader_of`); `allow(migration)`: whether a move may run now (default: all; a move not allowed waits, as a
        deferred one)."""
        self.policy, self.peer_id, self.epoch_s = policy, peer_id, epoch_s
        self._kv_bytes_per_token = kv_bytes_per_token  # of a session over `blocks` blocks, per token
        self._group, self._report, self._migrate = group, report, migrate
        self._leads = leads or (lambda members: leader_of(members) == self.peer_id)
        self._allow = allow
        self._packing: SegmentPacking | None = None
        self._segment: tuple[int, int] | None = None
        self._accepting: dict[str, bool] = {}
        self._in_flight: dict[str, _Moving] = {}
        self.epochs = 0
        # moves run by mode, failed, deferred by the budgets; and, summed over epochs, moves that waited for room or
        # for their session's first step, and the exchanges batching made instead of moves
        self.moves = {"kv": 0, "replay": 0, "failed": 0, "deferred": 0, "no_room": 0, "settling": 0, "exchanged": 0}
        self.failed_epochs = 0  # epochs that raised something other than a SwarmError (logged with its traceback)

    @property
    def standby(self) -> set[str]:
        """Gives the members the last epoch made standbys (not to take new sessions)."""
        return {peer for peer, accepting in self._accepting.items() if not accepting}

    async def run(self) -> None:
        """Runs epochs until cancelled."""
        while True:
            started = time.monotonic()
            try:
                await self.epoch()
            except SwarmError as error:
                log.info("packing epoch skipped: %s: %s", type(error).__name__, error.message)
            except Exception:  # a bug must cost one epoch, not the segment's packing for the server's lifetime
                self.failed_epochs += 1
                log.exception("packing epoch failed")
            await asyncio.sleep(max(0.0, self.epoch_s - (time.monotonic() - started)))

    async def epoch(self) -> None:
        """One epoch, if this server leads its group (see the module docstring)."""
        members = await self._group()
        if not self._leads(members) or len(members) < 2:
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
        sessions = [session for report in reports.values() for session in report.sessions]
        reported = {session.session_id for session in sessions}
        self._in_flight = {sid: moving for sid, moving in self._in_flight.items()
                           if moving.going(sid in reported, self.epochs)}
        plan = self._packing.epoch({peer: report.capacity_pages for peer, report in reports.items()}, sessions,
                                   in_flight={sid: moving.destination for sid, moving in self._in_flight.items()})
        self._accepting = plan.accepting
        self.epochs += 1
        self.moves["no_room"] += plan.no_room
        self.moves["settling"] += plan.settling
        self.moves["exchanged"] += plan.exchanges
        migrations = plan.migrations
        if self._allow is not None:
            migrations = [migration for migration in migrations if self._allow(migration)]
            self.moves["deferred"] += len(plan.migrations) - len(migrations)
        kv, replay, deferred = self._split(migrations, by_peer, reports)
        self.moves["deferred"] += len(deferred)
        for migration, mode in [(m, "kv") for m in kv] + [(m, "replay") for m in replay]:
            task = asyncio.create_task(self._move(migration, mode))
            self._in_flight[migration.session_id] = _Moving(task, migration.dst, mode == "replay", self.epochs)

    def _split(self, migrations: list[Migration], records: dict[str, ServerRecord], reports: dict[str, Report]
               ) -> tuple[list[Migration], list[Migration], list[Migration]]:
        """Splits the epoch's migrations by the spec's budgets; a move too large for any one epoch goes alone, in
        the mode `choose_mode` picks for it."""
        links: dict[tuple[str, str], float] = {}
        replays: dict[str, float] = {}
        costs: dict[tuple[str, str], MigrationCosts] = {}
        for migration in migrations:
            link = (migration.src, migration.dst)
            measured = reports[migration.src].links.get(migration.dst) if migration.src in reports else None
            costs[link] = cost = self._costs(records[migration.src], records[migration.dst], measured)
            links[link] = cost.link_budget_bytes
            replays[migration.dst] = cost.replay_budget_tokens
        kv, replay, deferred = split_migrations(migrations, links, replays)
        waiting = []
        for migration in deferred:
            cost = costs[(migration.src, migration.dst)]
            if cost.fits_no_budget(migration):
                (kv if choose_mode(cost, migration.replay_tokens) == "kv" else replay).append(migration)
            else:
                waiting.append(migration)
        return kv, replay, waiting

    def _costs(self, source: ServerRecord, destination: ServerRecord, measured_bytes_per_s: float | None
               ) -> MigrationCosts:
        """Gives a move's costs as a source prices its own (`move_costs`): the bandwidth the source's KV transfers
        to that destination achieved, else the one the two records announce; the leader measures no RTT between
        members, nor the client's upload of a replay."""
        blocks = destination.block_end - destination.block_start
        bandwidth = measured_bytes_per_s or announced_bytes_per_s(source.network_mbps, destination.network_mbps)
        return move_costs(
            kv_bytes_per_token=self._kv_bytes_per_token(blocks), bandwidth_bytes_per_s=bandwidth, rtt_s=0.0,
            prefill_s_per_token=prefill_ms_per_token(destination) * blocks / 1000, replay_bytes_per_token=0,
            epoch_s=self.epoch_s,
        )

    async def _move(self, migration: Migration, mode: str) -> bool:
        try:
            await self._migrate(migration.src, migration.session_id, migration.dst, mode)
            self.moves[mode] += 1
            return True
        except SwarmError as error:
            self.moves["failed"] += 1
            log.info("packing: moving session %s from %s to %s failed: %s: %s", migration.session_id,
                     migration.src, migration.dst, type(error).__name__, error.message)
            return False

    def to_wire(self) -> dict[str, Any]:
        return {"policy": self.policy, "epochs": self.epochs, "failed_epochs": self.failed_epochs,
                "moves": dict(self.moves),
                "accepting": dict(self._accepting)}
