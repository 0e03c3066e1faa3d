"""KunServe led by the orchestrator (`swarm-orchestrator --kv-dropping`): the segments its followers share drop and
restore blocks by the orchestrator's word, and JFFC dispatches over GCA's chains on the ranges they serve.

Per segment that two or more followers share (the range each hosts, or can restore once it dropped), a
`DropLoop` runs with the orchestrator as its leader (the servers' own loop, `--kv-dropping` without an orchestrator,
elects one of them). Its samples read each member's fresh record (its KV pages and `kv_demand_pages`) plus the
sessions waiting in JFFC's queue, each taking the mean job's KV on the segment's blocks: with an orchestrator the
burst waits there, not in refusals the servers count. A plan goes to the members as `drop` and `restore` calls
(servers take them from their orchestrators); after each, the orchestrator re-runs GCA on the ranges the followers
serve now and installs the chains, so that new sessions run through the buddy groups as chains and, after a restore,
through whole servers again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from orchestrator.buddy.segment_loop import DropLoop, restored_of, segment_of
from orchestrator.replan import Range
from swarm.memory import kv_pages_for
from swarm.records import ServerRecord

log = logging.getLogger(__name__)

FreshRecord = Callable[[ServerRecord], Awaitable[ServerRecord]]
Call = Callable[[ServerRecord, str, dict[str, object]], Awaitable[object]]


class FollowerDropping:
    """The orchestrator's drop loops, one per segment its followers share."""

    def __init__(self, peer_id: str, *, fresh: FreshRecord, call: Call, queued_tokens: Callable[[], int],
                 period_s: float, restore_after_s: float, restore_calm_s: float) -> None:
        """`fresh(record)` gives a follower's record as it answers now; `call(record, method, payload)` calls it;
        `queued_tokens()` gives the KV tokens per block the sessions waiting in JFFC's queue will take."""
        self.peer_id, self.fresh, self.call, self.queued_tokens = peer_id, fresh, call, queued_tokens
        self.period_s, self.restore_after_s, self.restore_calm_s = period_s, restore_after_s, restore_calm_s
        self.loops: dict[Range, DropLoop] = {}
        self._members: dict[Range, dict[str, ServerRecord]] = {}

    async def tick(self, followers: dict[str, ServerRecord], now_s: float) -> bool:
        """Runs every segment's loop once; gives whether a drop or a restore changed some follower's range."""
        segments: dict[Range, dict[str, ServerRecord]] = {}
        for record in followers.values():
            segments.setdefault(segment_of(record), {})[record.peer_id] = record
        self._members = {segment: members for segment, members in segments.items() if len(members) >= 2}
        for segment, loop in self.loops.items():
            if segment not in self._members:
                # a member's record may lag a moment (a range just assigned, a restart): the loop keeps what it
                # did (drops, restores, the members it told to drop), not its samples
                loop.forget_samples()
        changed = False
        for segment in sorted(self._members):
            loop = self.loops.get(segment)
            if loop is None:
                loop = self.loops[segment] = self._loop(segment)
            before = (loop.drops, loop.restores)
            await loop.tick(now_s)
            changed |= (loop.drops, loop.restores) != before
        return changed

    def _loop(self, segment: Range) -> DropLoop:
        async def group() -> list[ServerRecord]:
            return [await self.fresh(record) for record in self._members.get(segment, {}).values()]

        async def drop(peer_id: str, start: int, end: int, reserve: int) -> None:
            await self.call(self._members[segment][peer_id], "drop", {"blocks": [start, end], "reserve": reserve})

        async def restore(peer_id: str, evict_merged: bool) -> bool:
            return restored_of(await self.call(self._members[segment][peer_id], "restore",
                                               {"evict_merged": evict_merged}))

        def queued_pages(records: list[ServerRecord]) -> int:
            tokens = self.queued_tokens()
            if not records or not tokens:
                return 0
            tokens_per_page = max(1, records[0].page_bytes // max(1, records[0].kv_bytes_per_token))
            return (segment[1] - segment[0]) * kv_pages_for(tokens, tokens_per_page)

        return DropLoop(self.peer_id, group=group, drop=drop, restore=restore, period_s=self.period_s,
                        restore_after_s=self.restore_after_s, restore_calm_s=self.restore_calm_s, leads=True,
                        extra_demand=queued_pages)

    def to_wire(self) -> dict[str, object]:
        """The loops of the segments two or more followers share now."""
        return {f"{start}:{end}": loop.to_wire() for (start, end), loop in sorted(self.loops.items())
                if (start, end) in self._members}

