"""Migrations that take time, for the KV-packing simulator: each planned move becomes a hop of its session, split
into a KV transfer or a token replay within the epoch's budgets (`split_migrations`), timed, and held on both sides.

- A hop is (src, dst) of one session. Hops of a session run one after another; a hop starts at an epoch boundary.
- Every epoch the first waiting hop of each session is offered to `split_migrations` with the spec's budgets (6.12):
  B_comm = comm_share x bandwidth x epoch per destination's ingress (the link migrations converge on, as in the
  paper's Fig. 9), B_comp = the replay tokens whose prefill fits in comp_share x epoch per destination.
- Durations: a KV transfer takes kv_bytes / bandwidth + RTT and holds its source's egress and its destination's
  ingress (one transfer at a time on each NIC, first come first served, across epochs); a replay takes tokens x
  prefill time per token on its destination (one at a time there).
- A move that fits neither budget even when it is empty would be deferred forever: it runs anyway, by the mode that
  finishes first given those queues ("oversized") [chosen]. Other deferred hops wait for the next epoch; the session
  stays where it is meanwhile.
- With batching, a new hop of a session whose last hop has not started yet is merged with it (a -> b, b -> c give
  a -> c; a -> b, b -> a give nothing), as `batch_operations` prunes within an epoch; one by one, hops only queue.
- With a room rule (`start`'s `room`), a hop also waits while its destination lacks the pages for it.
- While a hop runs, or waits, the session's pages are held at its source as well as at the packer's bin for it (and
  at the running hop's destination): `holdings` gives where and for which share of the epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from orchestrator.packing import Migration, MigrationCosts, split_migrations

KV, REPLAY = "kv", "replay"


def _ingress(src: str, dst: str) -> str:
    """Gives the link a migration's KV budget is counted on: its destination's ingress."""
    return dst


@dataclass
class Hop:
    """One move of one session; `mode`, `start_s` and `end_s` are set once it runs."""

    src: str
    dst: str
    mode: str | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    not_before_s: float = 0.0  # it is offered from this time on

    @property
    def running(self) -> bool:
        return self.mode is not None


@dataclass
class StartedCounts:
    """What one epoch started: KV transfers, replays, the oversized among them, and the hops left waiting."""

    kv: int = 0
    replay: int = 0
    oversized: int = 0
    deferred: int = 0
    seconds: float = 0.0  # sum of the started hops' durations (queueing included)


class MigrationQueue:
    """The hops of every migrating session, the links' and destinations' transfer queues, and the timing rules."""

    def __init__(self, costs: MigrationCosts, *, merge: bool) -> None:
        self.costs = costs
        self.merge = merge
        self.hops: dict[str, list[Hop]] = {}
        self._egress_free_s: dict[str, float] = {}
        self._ingress_free_s: dict[str, float] = {}
        self._replay_free_s: dict[str, float] = {}

    def sessions(self) -> Iterable[str]:
        return self.hops.keys()

    def plan(self, session_id: str, src: str, dst: str, *, not_before_s: float = 0.0) -> None:
        """Adds a planned move src -> dst of `session_id` after its other hops (merged when batching), offered from
        `not_before_s` on."""
        hops = self.hops.setdefault(session_id, [])
        if hops and hops[-1].dst != src:
            raise AssertionError(f"session {session_id}: a move from {src} but its last hop ends on {hops[-1].dst}")
        if self.merge and hops and not hops[-1].running:
            last = hops.pop()
            if last.src != dst:
                hops.append(Hop(last.src, dst, not_before_s=max(last.not_before_s, not_before_s)))
        else:
            hops.append(Hop(src, dst, not_before_s=not_before_s))
        if not hops:
            del self.hops[session_id]

    def drop(self, session_id: str) -> None:
        """Forgets a departed session's hops (a running transfer is abandoned and frees both sides)."""
        self.hops.pop(session_id, None)

    def finish(self, now_s: float) -> None:
        """Completes the running hops that ended by `now_s`."""
        for session_id in list(self.hops):
            hops = self.hops[session_id]
            while hops and hops[0].running and hops[0].end_s <= now_s:
                hops.pop(0)
            if not hops:
                del self.hops[session_id]

    def idle(self) -> bool:
        return not self.hops

    def waiting_at(self) -> dict[str, str]:
        """Gives, for each session whose next hop has not started, where its KV is (or lands) meanwhile."""
        return {s: self._next_waiting(s).src for s, hops in self.hops.items() if not hops[-1].running}

    def on(self, session_id: str, logical_bin: str) -> set[str]:
        """Gives the bins the session's KV is on now: its source until a hop that takes it away ends, and the
        destinations of its running hops (the packer's bin if it is not moving)."""
        hops = self.hops.get(session_id)
        if not hops:
            return {logical_bin}
        running = [hop for hop in hops if hop.running]
        return {running[0].src, *(hop.dst for hop in running)} if running else {hops[0].src}

    def start(self, now_s: float, tokens_of: Callable[[str], int],
              room: tuple[dict[str, int], Callable[[str], int]] | None = None) -> StartedCounts:
        """Starts this epoch's hops: split by what is left of the budgets, timed on their NIC or prefill queue.

        A session's next hop is offered once the one before it has started; it starts when that one ends. With
        `room` (free pages per bin now, pages of a session), a hop waits while its destination has no room for
        the session, as a live segment's leader holds back such a move: as the leader counts them
        (`SegmentPacking.epoch`), a hop offered takes its pages on its destination and gives them back on its source at
        once, whether or not the budgets then let it start this epoch.
        """
        costs = self.costs
        used_bytes: dict[str, float] = {}
        used_tokens: dict[str, float] = {}
        counts = StartedCounts()
        offered = {s for s, hops in self.hops.items()
                   if any(not hop.running for hop in hops) and self._next_waiting(s).not_before_s <= now_s}
        while offered:
            waiting = []
            for session_id in sorted(offered):
                tokens = tokens_of(session_id)
                hop = self._next_waiting(session_id)
                if room is not None:
                    free, pages = room[0], room[1](session_id)
                    if free.get(hop.dst, 0) < pages:
                        counts.deferred += 1
                        continue
                    free[hop.dst] = free.get(hop.dst, 0) - pages
                    free[hop.src] = free.get(hop.src, 0) + pages
                waiting.append(Migration(session_id, hop.src, hop.dst, tokens * costs.kv_bytes_per_token, tokens))
            links = {m.dst: costs.link_budget_bytes - used_bytes.get(m.dst, 0.0) for m in waiting}
            computes = {m.dst: costs.replay_budget_tokens - used_tokens.get(m.dst, 0.0) for m in waiting}
            kv_moves, replay_moves, deferred = split_migrations(waiting, links, computes, link_of=_ingress)
            for migration in kv_moves:
                used_bytes[migration.dst] = used_bytes.get(migration.dst, 0.0) + migration.kv_bytes
                self._run(migration, KV, now_s, counts)
            for migration in replay_moves:
                used_tokens[migration.dst] = used_tokens.get(migration.dst, 0.0) + migration.replay_tokens
                self._run(migration, REPLAY, now_s, counts)
            ran = {m.session_id for m in (*kv_moves, *replay_moves)}
            for migration in deferred:
                if self.costs.fits_no_budget(migration):
                    kv_end = self._kv_start(migration, now_s) + costs.kv_seconds(migration.replay_tokens)
                    replay_end = self._replay_start(migration, now_s) + self._replay_s(migration)
                    self._run(migration, KV if kv_end <= replay_end else REPLAY, now_s, counts)
                    counts.oversized += 1
                    ran.add(migration.session_id)
                else:
                    counts.deferred += 1
            offered = {s for s in ran if not self.hops[s][-1].running and self._next_waiting(s).not_before_s <= now_s}
        return counts

    def _next_waiting(self, session_id: str) -> Hop:
        return next(hop for hop in self.hops[session_id] if not hop.running)

    def _earliest(self, session_id: str, now_s: float) -> float:
        """Gives when the session's next waiting hop may start: now, or when its hop before ends."""
        hops = self.hops[session_id]
        index = next(i for i, hop in enumerate(hops) if not hop.running)
        return max(now_s, hops[index - 1].end_s) if index else now_s

    def _kv_start(self, migration: Migration, now_s: float) -> float:
        return max(
            self._earliest(migration.session_id, now_s),
            self._egress_free_s.get(migration.src, now_s),
            self._ingress_free_s.get(migration.dst, now_s),
        )

    def _replay_start(self, migration: Migration, now_s: float) -> float:
        return max(self._earliest(migration.session_id, now_s), self._replay_free_s.get(migration.dst, now_s))

    def _replay_s(self, migration: Migration) -> float:
        return self.costs.replay_seconds(migration.replay_tokens)

    def _run(self, migration: Migration, mode: str, now_s: float, counts: StartedCounts) -> None:
        hop = self._next_waiting(migration.session_id)
        if mode == KV:
            start = self._kv_start(migration, now_s)
            end = start + self.costs.kv_seconds(migration.replay_tokens)
            self._egress_free_s[migration.src] = self._ingress_free_s[migration.dst] = end
            counts.kv += 1
        else:
            start = self._replay_start(migration, now_s)
            end = start + self._replay_s(migration)
            self._replay_free_s[migration.dst] = end
            counts.replay += 1
        hop.mode, hop.start_s, hop.end_s = mode, start, end
        counts.seconds += end - now_s

    def holdings(self, session_id: str, logical_bin: str, now_s: float) -> dict[str, float]:
        """Gives each bin holding the session's pages during the epoch from `now_s`, with the share of it held.

        The packer's bin holds them all epoch. The bin the KV is on holds them until the running hop that takes
        them away ends (all epoch if the first hop waits); a running hop's destination holds them from now until
        the next hop, if running, ends (else all epoch).
        """
        epoch_s = self.costs.epoch_s

        def share(end_s: float) -> float:
            return min(1.0, max(0.0, (end_s - now_s) / epoch_s))

        held = {logical_bin: 1.0}
        hops = self.hops.get(session_id, [])
        running = [hop for hop in hops if hop.running]
        if not running:
            if hops:
                held[hops[0].src] = 1.0
            return held
        held[running[0].src] = max(held.get(running[0].src, 0.0), share(running[0].end_s))
        for index, hop in enumerate(running):
            until = share(running[index + 1].end_s) if index + 1 < len(running) else 1.0
            held[hop.dst] = max(held.get(hop.dst, 0.0), until)
        return held
