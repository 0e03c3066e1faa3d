"""The KV-packing simulator (issue 12, spec `specs/mell.md` 5.6): sessions whose KV grows token by token, packed on
bins of C pages by any `Packer` (MELL or a baseline, unchanged), epoch by epoch, with migrations that take time.

Time runs in epochs of `epoch_s`. A session arriving in (t_{k-1}, t_k] is admitted at the boundary t_k (its prefill
is taken as instantaneous) and then decodes `decode_tokens_per_s` (or its own rate); after n epochs it holds
prompt + min(output, floor(n x rate x epoch)) tokens, and it departs at the first boundary where all its output is
decoded. At each boundary the packer gets the epoch's operations, in batching order (Departs, Updates, Allocates):
Allocate for admissions, Update for sessions whose page count changed, Depart for completions. A session's pages are
what it will hold by the END of the coming epoch, ceil(tokens / tokens_per_page), so that the packer's bins never
overflow between boundaries (a server reserves ahead by at most one epoch of decoding) [chosen]. With
`reserve_final` a session takes its final size at admission instead (spec 5.2, phase 1) and no Update ever fires: a
packer then never needs to move a session for its growth, and the records tell what it reserved (`packed_pages`) from
what the KV fills (`kv_pages`, the growing size either way).

A session with a `landed` bin (a live run replayed: where its client's route put it) is allocated like any other,
and moves from `landed` to the packer's bin for it, as a live segment's packing moves an arrival [adapted, as
`orchestrator.packing.live_epoch`]; its other moves in the epoch of its arrival are folded into that one, and the
move starts one epoch later at the earliest, as the live packing moves no session before its first step arrived.

With `batching`, the epoch's moves are pruned, and same-class units traded back in place, as `batch_operations`
does; without it every operation's moves run, in the same order (the trades make later epochs differ: which
sessions share a bin). The epoch is run by `batch_operations`' own parts (`epoch_order`, `apply_operation`,
`settled_moves`) so that an operation that raises
`NoFreeBin` can be skipped without losing the moves of the others; without failures the result is that of
`batch_operations` (tested). On `NoFreeBin`, an arrival is REJECTED (counted, never queued) and a session that
cannot grow is EVICTED (departed, counted) [chosen]; a departure that fails is retried at the next boundary.

Moves are timed by `packing_sim_moves`; while one runs (or waits for its budget) both sides hold the session's pages,
and a bin is active while the packer has sessions on it or it holds such pages. Occupancy is integrated over time:
an epoch's record gives the active bins and pages held at its start and their integrals over it. The packer's loads
never exceed C; with moves in flight a bin may hold more (`max_held_pages`): the reserve a server needs to migrate.
Pure and deterministic: no clock, no global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.packing import Allocate, Depart, Item, ItemTooLarge, Move, NoFreeBin, Operation, Packer, Update
from orchestrator.packing.batching import apply_operation, epoch_order, settled_moves
from orchestrator.sim.packing_sim_moves import MigrationQueue, StartedCounts
from orchestrator.sim.packing_sim_records import (
    EpochRecord,
    PackingSimConfig,
    PackingSimResult,
    PackingSimSummary,
    SessionSpec,
)

__all__ = ["EpochRecord", "PackingSimConfig", "PackingSimResult", "PackingSimSummary", "SessionSpec", "simulate"]


@dataclass
class _Running:
    spec: SessionSpec
    admitted: int  # epoch index
    finish: int  # epoch index of its departure
    pages: int


class _Totals:
    def __init__(self) -> None:
        self.kv = self.replay = self.oversized = self.deferred = 0
        self.migration_s = 0.0
        self.planned = self.unbatched = 0
        self.max_packed = self.max_held = 0


def simulate(sessions: Sequence[SessionSpec], packer: Packer, config: PackingSimConfig) -> PackingSimResult:
    """Runs `sessions` on `packer` until every one has departed (or was rejected) and no move is left."""
    ids = [s.session_id for s in sessions]
    if len(set(ids)) != len(ids):
        raise ValueError("session ids must be unique")
    if packer.active_bins():
        raise ValueError("give the simulator a packer with no session on it")
    return _Simulation(sessions, packer, config).run()


class _Simulation:
    def __init__(self, sessions: Sequence[SessionSpec], packer: Packer, config: PackingSimConfig) -> None:
        self.config, self.packer = config, packer
        self.arrivals: dict[int, list[SessionSpec]] = {}
        for spec in sorted(sessions, key=lambda s: (s.arrival_s, s.session_id)):
            epoch = max(0, math.ceil(spec.arrival_s / config.epoch_s - 1e-12))
            self.arrivals.setdefault(epoch, []).append(spec)
        self.running: dict[str, _Running] = {}
        self.stuck: list[str] = []  # departures that raised NoFreeBin, retried next epoch
        self.moves = MigrationQueue(config.costs, merge=config.batching)
        self.records: list[EpochRecord] = []
        self.departed_s: dict[str, float] = {}
        self.rejected: list[str] = []
        self.evicted: list[str] = []
        self.totals = _Totals()
        self.sessions = len(sessions)

    # ---- sizes

    def tokens_per_epoch_of(self, spec: SessionSpec) -> float:
        rate = spec.decode_tokens_per_s if spec.decode_tokens_per_s is not None else self.config.decode_tokens_per_s
        return rate * self.config.epoch_s

    def tokens(self, run: _Running, epoch: int) -> int:
        decoded = math.floor((epoch - run.admitted) * self.tokens_per_epoch_of(run.spec))
        return run.spec.prompt_tokens + min(run.spec.output_tokens, decoded)

    def pages_ahead(self, run: _Running, epoch: int) -> int:
        if self.config.reserve_final:
            return self.config.pages(run.spec.final_tokens)
        return self.pages_used(run, epoch)

    def pages_used(self, run: _Running, epoch: int) -> int:
        """Gives the pages the session's KV fills by the end of the coming epoch, whatever it reserved."""
        return self.config.pages(self.tokens(run, epoch + 1))

    # ---- the loop

    def run(self) -> PackingSimResult:
        last_arrival = max(self.arrivals, default=-1)
        epoch = 0
        while epoch <= last_arrival or self.running or self.stuck or not self.moves.idle():
            self.step(epoch)
            if epoch > last_arrival and self.stuck and set(self.running) <= set(self.stuck):  # nothing will change
                raise RuntimeError(f"departing {sorted(self.stuck)} needs a bin the packer does not have: give it more")
            epoch += 1
        return PackingSimResult(self.summary(), self.records, self.departed_s, self.rejected, self.evicted)

    def step(self, epoch: int) -> None:
        now = epoch * self.config.epoch_s
        self.moves.finish(now)
        operations, admitted = self.operations(epoch)
        moves, unbatched, departed, rejected = self.apply(operations, admitted)
        for session_id in departed:
            self.running.pop(session_id, None)
            self.moves.drop(session_id)
            self.departed_s[session_id] = now
        for move in moves:
            landing = move.session_id in admitted and self.running[move.session_id].spec.landed is not None
            self.moves.plan(move.session_id, move.src, move.dst,
                            not_before_s=now + self.config.epoch_s if landing else 0.0)
        room = (self.free_pages(), lambda s: self.running[s].pages) if self.config.moves_wait_for_room else None
        started = self.moves.start(now, lambda s: self.tokens(self.running[s], epoch), room)
        totals = self.totals
        totals.kv += started.kv
        totals.replay += started.replay
        totals.oversized += started.oversized
        totals.deferred += started.deferred
        totals.migration_s += started.seconds
        totals.planned += len(moves)
        totals.unbatched += len(unbatched)
        if self.config.check_invariants:
            self.packer.check_invariants()
        self.records.append(
            self.record(epoch, now, operations, departed, rejected, len(moves), len(unbatched), started)
        )

    def operations(self, epoch: int) -> tuple[list[Operation], set[str]]:
        operations: list[Operation] = [Depart(s) for s in self.stuck]
        retried = set(self.stuck)
        self.stuck = []
        for session_id, run in self.running.items():
            if session_id in retried:
                continue
            if run.finish == epoch:
                operations.append(Depart(session_id))
                continue
            pages = self.pages_ahead(run, epoch)
            if pages != run.pages:
                operations.append(Update(session_id, pages))
        admitted = set()
        for spec in self.arrivals.pop(epoch, []):
            decode_epochs = max(1, math.ceil(spec.output_tokens / self.tokens_per_epoch_of(spec)))
            run = _Running(spec, epoch, epoch + decode_epochs, 0)
            run.pages = self.pages_ahead(run, epoch)
            self.running[spec.session_id] = run
            admitted.add(spec.session_id)
            operations.append(Allocate(Item(spec.session_id, run.pages)))
        return operations, admitted

    def apply(self, operations: list[Operation], admitted: set[str]) -> tuple[list[Move], list[Move], list[str], int]:
        """Runs the epoch's operations; gives (moves to execute, moves one by one, departed sessions, rejections)."""
        packer = self.packer
        buffered: list[Move] = []
        departed: list[str] = []
        rejected = 0
        for operation in epoch_order(operations):
            try:
                buffered.extend(apply_operation(packer, operation))
            except (NoFreeBin, ItemTooLarge):
                if isinstance(operation, Allocate):
                    session_id = operation.item.item_id
                    self.running.pop(session_id)
                    admitted.discard(session_id)
                    self.rejected.append(session_id)
                    rejected += 1
                elif isinstance(operation, Update):
                    buffered.extend(self.evict(operation.item_id, departed))
                else:
                    self.stuck.append(operation.item_id)
                continue
            if isinstance(operation, Depart):
                departed.append(operation.item_id)
            elif isinstance(operation, Update):
                self.running[operation.item_id].pages = operation.new_pages
        landings = self.landings(admitted)
        buffered = [m for m in buffered if m.session_id not in landings] + list(landings.values())
        if self.config.batching:
            executed = settled_moves(packer, buffered, departed, admitted - set(landings), self.moves.waiting_at())
            return executed, buffered, departed, rejected
        # one by one, an arrival's KV is where its Allocate put it, and its later moves in the epoch carry it on
        gone = set(departed)
        return [m for m in buffered if m.session_id not in gone], buffered, departed, rejected

    def free_pages(self) -> dict[str, int]:
        """Gives each bin's pages not held now by the KV on it (sessions there, moves into it running)."""
        free = dict.fromkeys(self.packer.bins, self.config.capacity_pages)
        for session_id, run in self.running.items():
            for bin_id in self.moves.on(session_id, self.packer.bin_of(session_id)):
                free[bin_id] -= run.pages
        return free

    def landings(self, admitted: set[str]) -> dict[str, Move]:
        """Gives the move of each admitted session that landed on a bin other than the packer's for it."""
        moves = {}
        for session_id in sorted(admitted):
            run = self.running[session_id]
            landed, packed = run.spec.landed, self.packer.bin_of(session_id)
            if landed is not None and landed != packed:
                moves[session_id] = Move(session_id, landed, packed, run.pages, session_id)
        return moves

    def evict(self, session_id: str, departed: list[str]) -> list[Move]:
        try:
            moves = self.packer.depart(session_id)
        except NoFreeBin:
            self.stuck.append(session_id)
            return []
        departed.append(session_id)
        self.evicted.append(session_id)
        return moves

    # ---- accounting

    def record(
        self,
        epoch: int,
        now: float,
        operations: list[Operation],
        departed: list[str],
        rejected: int,
        planned: int,
        unbatched: int,
        started: StartedCounts,
    ) -> EpochRecord:
        packer, epoch_s = self.packer, self.config.epoch_s
        loads = {b: packer.load(b) for b in packer.active_bins()}
        held_start = dict(loads)
        extra_share: dict[str, float] = {}
        extra_page_s = extra_kv_page_s = 0.0
        for session_id in self.moves.sessions():
            logical = packer.bin_of(session_id)
            run = self.running[session_id]
            for bin_id, share in self.moves.holdings(session_id, logical, now).items():
                if bin_id == logical:
                    continue
                held_start[bin_id] = held_start.get(bin_id, 0) + run.pages
                extra_page_s += run.pages * share * epoch_s
                extra_kv_page_s += self.pages_used(run, epoch) * share * epoch_s
                if bin_id not in loads:
                    extra_share[bin_id] = max(extra_share.get(bin_id, 0.0), share)
        kv_pages = sum(self.pages_used(run, epoch) for run in self.running.values())
        packed = sum(loads.values())
        totals = self.totals
        totals.max_packed = max(totals.max_packed, max(loads.values(), default=0))
        totals.max_held = max(totals.max_held, max(held_start.values(), default=0))
        return EpochRecord(
            t_s=now,
            active_bins=len(held_start),
            packed_bins=len(loads),
            active_bin_s=(len(loads) + sum(extra_share.values())) * epoch_s,
            pages_held=sum(held_start.values()),
            page_s=packed * epoch_s + extra_page_s,
            packed_pages=packed,
            kv_pages=kv_pages,
            kv_page_s=kv_pages * epoch_s + extra_kv_page_s,
            arrivals=sum(isinstance(op, Allocate) for op in operations) - rejected,
            departures=len(departed),
            rejected=rejected,
            planned_moves=planned,
            unbatched_moves=unbatched,
            kv_migrations=started.kv,
            replay_migrations=started.replay,
            deferred=started.deferred,
        )

    def summary(self) -> PackingSimSummary:
        records, totals, capacity = self.records, self.totals, self.config.capacity_pages
        duration = records[-1].t_s if records else 0.0  # from 0 to the boundary where the last session departed
        bin_s = sum(r.active_bin_s for r in records)
        packed_page_s = sum(r.packed_pages for r in records) * self.config.epoch_s
        migrations = totals.kv + totals.replay
        return PackingSimSummary(
            packer=self.packer.name,
            batching=self.config.batching,
            sessions=self.sessions,
            completed=len(self.departed_s) - len(self.evicted),
            rejected=len(self.rejected),
            evicted=len(self.evicted),
            duration_s=duration,
            peak_active_bins=max((r.active_bins for r in records), default=0),
            peak_packed_bins=max((r.packed_bins for r in records), default=0),
            peak_bins_lower_bound=max((-(-r.packed_pages // capacity) for r in records), default=0),
            mean_active_bins=bin_s / duration if duration else 0.0,
            mean_utilization=sum(r.page_s for r in records) / (capacity * bin_s) if bin_s else 0.0,
            mean_packed_utilization=packed_page_s / (capacity * bin_s) if bin_s else 0.0,
            mean_kv_utilization=sum(r.kv_page_s for r in records) / (capacity * bin_s) if bin_s else 0.0,
            migrations=migrations,
            kv_migrations=totals.kv,
            replay_migrations=totals.replay,
            oversized_migrations=totals.oversized,
            migrations_per_s=migrations / duration if duration else 0.0,
            mean_migration_s=totals.migration_s / migrations if migrations else 0.0,
            planned_moves=totals.planned,
            unbatched_moves=totals.unbatched,
            moves_avoided_by_batching=totals.unbatched - totals.planned,
            deferrals=totals.deferred,
            max_packed_load_pages=totals.max_packed,
            max_held_pages=totals.max_held,
        )
