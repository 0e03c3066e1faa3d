"""MELL's epoch loop on a live segment (spec 3.7 and 5.1): one packer over the servers that host the same blocks,
fed each epoch with the sessions those servers report, giving the migrations that bring every session to the bin
the packer keeps it on and which servers should take new sessions.

Each epoch (`SegmentPacking.epoch`):
1. The reports become the epoch's operations: Allocate for a session the packer does not know yet, Update for one
   that holds more pages than the packer has for it, Depart for one no server reports any more. A session that
   reports fewer pages than the packer has (pages only grow; a move may round them differently) keeps its packed
   size [chosen]. They run in batching order (`epoch_order`); an Allocate or Update that finds no bin leaves that
   session unmanaged (it stays where it is, outside the packer) [chosen], like the simulator's rejections and
   evictions, and an unmanaged session is offered to the packer again the next epoch.
2. Live arrivals are already on a server (the client's route put them there) when the packer first sees them, so
   the packer's placement of an arrival is a move like any other [adapted]: every managed session whose reported
   server is not the bin the packer keeps it on gets a migration from the one to the other, unless a move of it is
   still in flight, or its first step has not arrived yet (`settling`: a move would race the prompt, or the replay,
   that is filling its KV), or its destination really holds too much to take it now (sessions the packer does not
   manage count there, and so do the sessions moving to it now; the move is offered again the next epoch)
   [chosen]. Batching then trades same-class units between bins so that fewer sessions end away from the server
   that reports them (`keep_in_place`, as `batch_operations` does), and what remains is one net move per session.
3. `accepting`: servers the packer has sessions on take new ones, and so does one more (the first idle server in
   the packer's order), so that arrivals always find room; the others are standbys [chosen].

The bins are the group's servers; when that set changes, the packer is rebuilt over the new set and the running
sessions are allocated again in the order of their ids, so the plan stays a function of the reports [chosen: a
join or a leave may cause a burst of moves]. C is the smallest KV capacity of the group (spec 5.2: one instance per
group whose capacities agree within 10%; the caller groups). Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from orchestrator.packing.batching import (
    Allocate,
    Depart,
    Operation,
    Update,
    apply_operation,
    epoch_order,
    keep_in_place,
)
from orchestrator.packing.migration_split import Migration
from orchestrator.packing.records import Item, ItemTooLarge, NoFreeBin, Packer

PackerFactory = Callable[[Sequence[str], int], Packer]


@dataclass(frozen=True)
class ReportedSession:
    """A session one server reports: where its KV is, the pages it holds there and its tokens; `settling` while its
    prompt (or the replay that brings it) has not arrived: it is packed, but not moved until it has."""

    session_id: str
    server: str
    pages: int
    tokens: int
    settling: bool = False


@dataclass(frozen=True)
class SegmentEpoch:
    """What one epoch decided for a segment: migrations to run, which servers take new sessions, the sessions the
    packer could not hold (left where they are), the exchanges batching made, and the moves the packer wants that
    wait: for room on their destination, or for their session's first step."""

    migrations: list[Migration]
    accepting: dict[str, bool]
    unmanaged: list[str] = field(default_factory=list)
    exchanges: int = 0
    no_room: int = 0
    settling: int = 0


class SegmentPacking:
    """One packer over the servers that host one segment, driven by their reports epoch by epoch."""

    def __init__(self, make_packer: PackerFactory, kv_bytes_per_token: int) -> None:
        self.make_packer = make_packer
        self.kv_bytes_per_token = kv_bytes_per_token
        self.packer: Packer | None = None
        self._servers: tuple[str, ...] = ()
        self._capacity = 0
        self._last: dict[str, ReportedSession] = {}  # the sessions of the last epoch

    def epoch(self, capacities: dict[str, int], reports: Iterable[ReportedSession],
              in_flight: Mapping[str, str] | None = None) -> SegmentEpoch:
        """Gives this epoch's plan for servers `capacities` (id -> KV pages) from the sessions they report; sessions
        in `in_flight` (session -> its destination) are moving now: they get no new migration, and their pages
        count on both sides (their destination took them as the move began; its report leaves them to the
        source's until the move commits); one that no server reports (a replay its client has not reopened yet)
        is kept, on its destination, as the last epoch saw it."""
        servers = tuple(sorted(capacities))
        sessions = {report.session_id: report for report in reports if report.server in capacities}
        moving = dict(in_flight or {})
        for session_id, destination in moving.items():  # moved by replay: on no server until its client reopens it
            last = self._last.get(session_id)
            if session_id not in sessions and last is not None and destination in capacities:
                sessions[session_id] = dataclasses.replace(last, server=destination, settling=True)
        self._last = sessions
        capacity = min(capacities.values(), default=0)
        if self.packer is None or servers != self._servers or capacity != self._capacity:
            self.packer = self.make_packer(servers, capacity) if servers and capacity > 0 else None
            self._servers, self._capacity = servers, capacity
        packer = self.packer
        if packer is None:
            return SegmentEpoch([], {server: True for server in servers}, sorted(sessions))
        unmanaged = self._run_operations(packer, self._operations(packer, sessions))
        # a session no server reports whose Depart found no bin (re-packing its neighbours needs one) stays packed
        # until a later epoch's Depart succeeds; it is on no server, so it neither moves nor anchors an exchange
        reported = [sid for sid in packer.assignment() if sid in sessions]
        exchanges = keep_in_place(packer, {sid: moving.get(sid, sessions[sid].server) for sid in reported})
        held = {server: 0 for server in servers}  # pages the servers really hold, unmanaged sessions included
        for report in sessions.values():
            held[report.server] += report.pages
            destination = moving.get(report.session_id)
            if destination in held and destination != report.server:
                held[destination] += report.pages
        migrations = []
        no_room = settling = 0
        for session_id, bin_id in sorted(packer.assignment().items()):
            report = sessions.get(session_id)
            if report is None:
                continue
            if bin_id == report.server or session_id in moving:
                continue
            if report.settling:
                settling += 1
                continue
            if held[bin_id] + report.pages > capacities[bin_id]:
                no_room += 1
                continue  # not yet: what it holds now leaves no room (it is offered again next epoch)
            held[bin_id] += report.pages
            held[report.server] -= report.pages
            migrations.append(Migration(session_id, report.server, bin_id, report.tokens * self.kv_bytes_per_token,
                                        report.tokens))
        return SegmentEpoch(migrations, self._accepting(packer), unmanaged, exchanges, no_room, settling)

    @staticmethod
    def _operations(packer: Packer, sessions: dict[str, ReportedSession]) -> list[Operation]:
        packed = packer.assignment()
        operations: list[Operation] = [Depart(sid) for sid in sorted(packed) if sid not in sessions]
        for session_id in sorted(sessions):
            pages = max(1, sessions[session_id].pages)
            if session_id not in packed:
                operations.append(Allocate(Item(session_id, pages)))
            elif pages > packer.pages_of(session_id):
                operations.append(Update(session_id, pages))
        return operations

    @staticmethod
    def _run_operations(packer: Packer, operations: Sequence[Operation]) -> list[str]:
        """Applies the operations in batching order; gives the sessions left out of the packer."""
        unmanaged = []
        for operation in epoch_order(operations):
            try:
                apply_operation(packer, operation)
            except (NoFreeBin, ItemTooLarge):
                if isinstance(operation, Allocate):
                    unmanaged.append(operation.item.item_id)
                elif isinstance(operation, Update):
                    try:
                        packer.depart(operation.item_id)
                    except NoFreeBin:
                        pass  # it keeps its old size in the packer
                    else:
                        unmanaged.append(operation.item_id)
        return sorted(unmanaged)

    @staticmethod
    def _accepting(packer: Packer) -> dict[str, bool]:
        active = set(packer.active_bins())
        spare = next((bin_id for bin_id in packer.bins if bin_id not in active), None)
        return {bin_id: bin_id in active or bin_id == spare for bin_id in packer.bins}

