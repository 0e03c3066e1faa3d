"""KunServe's loop over the servers of one segment, as its leader runs it (`swarm-server --kv-dropping`, without an
orchestrator). It does no I/O of its own: the caller gives it the members' fresh records and the drops and restores
as callables.

A segment is the range a server hosts, or, once it dropped blocks, the range it can restore; its servers that take
part in its drops (`--kv-dropping`, record `segment_dropping`) form a group whose leader is the online one with the
smallest peer id (every member computes the same from the DHT, as MELL's packing does). A server of the segment that
does not take part is no member: it keeps its range, and neither leads nor is planned for [chainswarm: before, it
counted, so a segment whose smallest peer id did not drop never dropped, and a plan that named it was aborted every
tick]. Every `period_s` the leader:
1. reads each member's record: KV demand (pages its KV holds, plus `kv_demand_pages`: its sessions' expected growth
   and what it refused for room in the last 5 s) and the pages that can hold KV (all but its parameters');
2. while nothing is dropped, runs `drop_trigger` on the segment's sums; when it asks for R pages, plans the drop
   (`plan_drop`: buddy groups, kept slices) and tells each member that keeps less than the segment to `drop`, its
   own hosting last. The plan is proposed and committed in one round: a member that refuses or fails aborts it, the
   leader asks the members that had dropped to restore, and leaves the member out of its plans for `REFUSED_PLAN_S`
   [chainswarm: a round of RPCs from the leader, in place of the spec's propose-commit over DHT records; without
   the pause the same plan was proposed to it again at the next tick, and the members before it dropped and
   restored every 0.5 s];
3. while blocks are dropped, runs `restore_trigger` and tells every member that dropped to `restore`; at once, whatever
   the trigger says, when a block of the segment is left without an online server (a member that kept it left):
   then the members first evict the sessions of the group's chain, which is broken, to make room for the blocks;
4. while blocks are dropped, no restore is due and no member is `reshaping` (until an exchange ends, its victims
   hold KV on both sides and the blocks they left still hold their parameter pages: the records understate what
   the drop freed), runs `drop_trigger` again: a burst that outgrows the first plan
   (the trigger's 1-s horizon asks for what the next second needs, not for the burst's peak) merges the servers still
   whole into groups of their own, and once fewer than two are whole, merges the smallest groups (`plan_merge`, Alg.
   1 continued: two pairs into a group of four, each member keeping half of its slice, so no dropped block has to
   come back; the victims' KV for the blocks a member no longer keeps moves to the member that keeps them, as after
   the first drop) [chainswarm: the spec plans once per throttling event, from whole servers]. One restore takes
   every dropped block back. A drop or restore makes the loop forget its samples of available pages, which jumped,
   not those of the demand, which did not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.buddy.exchange import incoming_pages
from orchestrator.buddy.groups import groups_of, plan_drop, plan_merge
from orchestrator.buddy.records import DropPlan, SegmentReplica
from orchestrator.buddy.triggers import (
    RESTORE_CALM_S,
    RESTORE_MIN_DROPPED_S,
    drop_trigger,
    restore_trigger,
    stale_count,
)
from orchestrator.packing.segment_loop import leader_of
from swarm.errors import SwarmError
from swarm.records import ServerRecord, ServerState

log = logging.getLogger(__name__)

DROP_PERIOD_S = 0.5
SAMPLES_KEPT = 8
REFUSED_PLAN_S = 10.0  # a member that refused or failed a plan is left out of the leader's plans this long


def segment_of(record: ServerRecord) -> tuple[int, int]:
    """Gives the segment a server belongs to: the range it can restore, else the range it hosts."""
    if record.restorable_start is not None and record.restorable_end is not None:
        return record.restorable_start, record.restorable_end
    return record.block_start, record.block_end


def drop_group(records: dict[str, ServerRecord], segment: tuple[int, int]) -> list[ServerRecord]:
    """Gives the online servers of `segment` that take part in its drops (`segment_dropping`), in peer-id order."""
    return sorted((record for record in records.values()
                   if record.state == ServerState.online and record.segment_dropping and segment_of(record) == segment),
                  key=lambda record: record.peer_id)


def uncovered_blocks(records: Sequence[ServerRecord]) -> list[int]:
    """Gives the blocks of the records' segment that no online record among them hosts."""
    if not records:
        return []
    start, end = segment_of(records[0])
    hosted = {block for record in records if record.state == ServerState.online
              for block in range(record.block_start, record.block_end)}
    return [block for block in range(start, end) if block not in hosted]


def params_pages_per_block(record: ServerRecord) -> int:
    return max(1, record.pages_params // max(1, record.block_end - record.block_start))


def restored_of(reply: object) -> bool:
    """Gives whether a member's answer to `restore` says it had dropped blocks to load back (an answer without the
    field, from a server before it: True)."""
    return not isinstance(reply, dict) or reply.get("restored", True) is not False


def kv_held_pages(record: ServerRecord) -> int:
    """Gives the KV pages a member's sessions hold, a session that took no step yet counted at its announced prompt
    (`kv_packed_pages`; a record without it: `pages_kv`): what its victims bring to the mates that keep their blocks
    after a drop."""
    return max(record.pages_kv, record.kv_packed_pages)


def replica_of(record: ServerRecord) -> SegmentReplica:
    start, end = segment_of(record)
    return SegmentReplica(record.peer_id, start, end, params_pages_per_block(record),
                          pages_free=record.pages_free, pages_kv=record.pages_kv,
                          tau_p_ms=record.block_compute_ms or 1.0, draining=record.state == ServerState.draining)


@dataclass
class DropLoop:
    """The segment's drop and restore decisions, taken while `peer_id` leads it."""

    peer_id: str
    group: Callable[[], Awaitable[list[ServerRecord]]]  # fresh records of the segment's online servers, own included
    # (member, start, end, reserve): keep only [start, end), holding `reserve` freed pages back for the KV the
    # member's group-mates' victims bring (`incoming_pages`)
    drop: Callable[[str, int, int, int], Awaitable[None]]
    # (member, evict_merged): load the dropped blocks back; gives whether the member had any to load (a record that
    # lags behind a restore names a member that has none)
    restore: Callable[[str, bool], Awaitable[bool]]
    period_s: float = DROP_PERIOD_S
    restore_after_s: float = RESTORE_MIN_DROPPED_S
    restore_calm_s: float = RESTORE_CALM_S
    balanced: bool = True
    leads: bool = False  # an orchestrator leads every segment of its followers; servers elect the smallest peer id
    # pages asked beyond the records' (an orchestrator's queue of waiting sessions), from the members' records
    extra_demand: Callable[[list[ServerRecord]], int] | None = None
    demand: list[tuple[float, int]] = field(default_factory=list)
    available: list[tuple[float, int]] = field(default_factory=list)
    dropped_since_s: float | None = None
    drops: int = 0
    restores: int = 0
    aborts: int = 0
    last_plan: DropPlan | None = None
    dropped_peers: set[str] = field(default_factory=set)  # told to drop since the last restore (records may lag)
    refused_until: dict[str, float] = field(default_factory=dict)  # member -> when plans may name it again

    async def run(self) -> None:
        while True:
            try:
                await self.tick(time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("drop loop tick failed")
            await asyncio.sleep(self.period_s)

    async def tick(self, now_s: float) -> None:
        """One look at the segment: samples its demand, then drops, restores or does nothing."""
        records = await self.group()
        if not self.leads and leader_of(records) != self.peer_id:
            self.forget_samples()
            return
        self._sample(now_s, records)
        dropped = [record for record in records
                   if record.restorable_start is not None or record.peer_id in self.dropped_peers]
        if dropped:
            self.dropped_since_s = self.dropped_since_s if self.dropped_since_s is not None else now_s
            capacity = sum(record.pages_total - params_pages_per_block(record) * (end - start)
                           for record in records for start, end in [segment_of(record)])
            uncovered = uncovered_blocks(records)
            if uncovered:
                log.warning("blocks %s of the segment have no online server: restoring at once", uncovered)
            if uncovered or restore_trigger(self.demand, capacity, now_s - self.dropped_since_s,
                                            min_dropped_s=self.restore_after_s, calm_s=self.restore_calm_s):
                await self._restore_all(dropped, evict_merged=bool(uncovered))
                return
            dropped_ids = {record.peer_id for record in dropped}
            whole = [record for record in records if record.peer_id not in dropped_ids]
            if any(record.reshaping for record in records):
                return  # an exchange runs: its victims hold KV on both sides, the dropped blocks' pages are not free
            required = drop_trigger(self.demand, self.available)
            whole = self._plannable(whole, now_s)
            if required > 0 and len(whole) > 1:
                await self._drop(whole, required, now_s)
            elif (required > 0 and all(record.restorable_start is not None for record in dropped)
                  and len(self._plannable(records, now_s)) == len(records)):
                await self._merge(records, required, now_s)
            return
        self.dropped_since_s = None
        required = drop_trigger(self.demand, self.available)
        if required > 0:
            await self._drop(self._plannable(records, now_s), required, now_s)

    def _plannable(self, records: list[ServerRecord], now_s: float) -> list[ServerRecord]:
        """Gives `records` less the members that refused or failed a plan in the last `REFUSED_PLAN_S`."""
        return [record for record in records if self.refused_until.get(record.peer_id, now_s) <= now_s]

    def _sample(self, now_s: float, records: list[ServerRecord]) -> None:
        extra = self.extra_demand(records) if self.extra_demand is not None else 0
        self.demand.append((now_s, extra + sum(record.pages_kv + record.kv_demand_pages for record in records)))
        available = sum(record.pages_total - record.pages_params for record in records)
        if self.available and self.available[-1][1] != available:
            # the members loaded or dropped parameters (a drop, a restore, a range assigned at start): a step, which
            # a rate would carry on over the horizon
            self.available.clear()
        self.available.append((now_s, available))
        # the demand for the restore's calm window, the available pages for the drop's rate
        del self.demand[:stale_count(self.demand, self.restore_calm_s)]
        del self.available[:-SAMPLES_KEPT]

    def forget_samples(self) -> None:
        """Drops the demand and available samples (the next ones start anew), keeping what the loop did."""
        self.demand.clear()
        self.available.clear()

    async def _drop(self, records: list[ServerRecord], required: int, now_s: float) -> None:
        plan = plan_drop([replica_of(record) for record in records], required, balanced=self.balanced,
                         epoch=self.drops + self.aborts + 1)
        if plan.changes_anything:
            await self._execute(plan, {record.peer_id: segment_of(record) for record in records}, now_s,
                                {record.peer_id: kv_held_pages(record) for record in records})

    async def _merge(self, records: list[ServerRecord], required: int, now_s: float) -> None:
        """Fewer than two servers are whole: merges the smallest groups the kept ranges form (`plan_merge`), each
        member keeping a part of its slice. Records that do not tile into groups yet (one lags behind a drop) wait
        for the next tick."""
        replicas = [replica_of(record) for record in records]
        kept = {record.peer_id: (record.block_start, record.block_end) for record in records}
        groups = groups_of(replicas, kept)
        if groups is None:
            return
        await self._execute(plan_merge(replicas, groups, kept, required, epoch=self.drops + self.aborts + 1), kept,
                            now_s, {record.peer_id: kv_held_pages(record) for record in records})

    async def _execute(self, plan: DropPlan, kept: dict[str, tuple[int, int]], now_s: float,
                       pages_kv: dict[str, int]) -> None:
        """Tells every member whose range the plan changes to keep its new one, holding back the pages its mates'
        victims' KV will take (`incoming_pages`, from the members' `kv_held_pages`); aborts the plan (and restores the
        members that dropped for it) when one refuses or fails."""
        samples = (f"demand {[pages for _, pages in self.demand[-2:]]}, "
                   f"KV pages {[pages for _, pages in self.available[-2:]]}")
        # the leader's own drop last: a member that refuses then leaves less to undo
        changes = {peer: blocks for peer, blocks in sorted(plan.kept.items(), key=lambda item: (
            item[0] == self.peer_id, item[0])) if blocks != kept[peer]}
        if not changes:
            return
        incoming = incoming_pages(plan, kept, pages_kv)
        dropped: list[str] = []
        try:
            for peer, blocks in changes.items():
                await self.drop(peer, *blocks, incoming.get(peer, 0))
                dropped.append(peer)
        except (SwarmError, OSError, TimeoutError) as error:
            self.aborts += 1
            refuser = next(peer for peer in changes if peer not in dropped)
            self.refused_until[refuser] = now_s + REFUSED_PLAN_S
            log.warning("drop plan %d aborted: %s refused or failed (%s: %s); restoring %s, and no plan names %s "
                        "for %g s", plan.epoch, refuser, type(error).__name__, error, dropped, refuser,
                        REFUSED_PLAN_S)
            for peer in dropped:
                await self._try_restore(peer)
            return
        self.drops += 1
        self.last_plan = plan
        self.dropped_peers.update(dropped)
        self.dropped_since_s = now_s
        self.available.clear()  # it jumped: a rate across the drop means nothing; demand's still does
        log.info("drop plan %d for %d pages (%s): groups %s, kept %s, %d pages freed, held back for the exchange %s",
                 plan.epoch, plan.required_pages, samples, [group.members for group in plan.groups], dict(plan.kept),
                 plan.total_freed_pages, {peer: incoming.get(peer, 0) for peer in changes})

    async def _restore_all(self, dropped: list[ServerRecord], *, evict_merged: bool = False) -> None:
        """Has every member in `dropped` load its dropped blocks back. Once all answered, the segment is whole; it
        counts as a restore if one of them had blocks to load (not when records lagged behind the last restore)."""
        answers = {record.peer_id: await self._try_restore(record.peer_id, evict_merged=evict_merged)
                   for record in dropped}
        if None in answers.values():
            return
        loaded = [peer for peer, had_blocks in answers.items() if had_blocks]
        self.dropped_peers.clear()
        self.dropped_since_s = None
        self.available.clear()
        if loaded:
            self.restores += 1
            log.info("restored the segment's blocks on %s", loaded)

    async def _try_restore(self, peer: str, *, evict_merged: bool = False) -> bool | None:
        """Gives whether `peer` loaded dropped blocks back; None if the call failed."""
        try:
            return await self.restore(peer, evict_merged)
        except (SwarmError, OSError, TimeoutError) as error:
            log.warning("restore on %s failed (%s: %s); trying again later", peer, type(error).__name__, error)
            return None

    def to_wire(self) -> dict[str, Any]:
        return {"drops": self.drops, "restores": self.restores, "aborts": self.aborts,
                "dropped": self.dropped_since_s is not None,
                "demand_pages": self.demand[-1][1] if self.demand else None,
                "available_pages": self.available[-1][1] if self.available else None,
                "plan": dict(self.last_plan.kept) if self.last_plan is not None else None,
                "plan_required_pages": self.last_plan.required_pages if self.last_plan is not None else None}
