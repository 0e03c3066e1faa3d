"""Adaptive request migration (Sec. V, spec 3.6): each migration of an epoch moves either its KV bytes over the link
(communication-heavy) or only its tokens, which the destination re-prefills (computation-heavy).

Every link has a byte budget per epoch and every destination a replay-token budget; the choice is a two-bin packing
solved greedily, first fit decreasing by KV bytes [inferred order]:
    kv_ok  = used_bytes[link] + kv_bytes <= link budget        tok_ok = used_tokens[dst] + tokens <= dst budget
    both:  the mode whose budget keeps the larger fraction free after it (ties: KV transfer) [inferred]
    one:   that mode;   neither: deferred to the next epoch, the session stays where it is [inferred]
Every instance runs this over the whole epoch's list, so the order must not depend on who computes it: migrations
are sorted by (-kv_bytes, session_id, src, dst), and each of the three lists comes out in that order whatever the
input order. A link or destination missing from its budget table has budget 0 [chosen]; a link is the (src, dst)
pair unless `link_of` maps pairs to shared links (e.g. one inter-machine switch).

Deferring is per migration: a deferred move whose freed pages another move of the same plan needs would overfill
that destination if the other move ran; the caller executes moves only where the pages are free, and reports the
sessions' real bins in the next epoch.

`MigrationCosts` is the cost model both the simulator and the live servers use: what a move takes in seconds by
either mode, and the budgets of one epoch. `choose_mode` is the rule for one move on its own (a server moving a
session now, when it drains or its client or orchestrator asks): `split_migrations` over that single move, with its
fixed costs (round trips) counted in the units of each budget, and a move that fits neither budget of one epoch takes
the mode that ends first, as the simulator's oversized moves do [chosen].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from orchestrator.packing.records import Move


@dataclass(frozen=True)
class Migration:
    """A planned move with its costs: the KV bytes to send, or the tokens the destination would re-prefill."""

    session_id: str
    src: str
    dst: str
    kv_bytes: int
    replay_tokens: int

    @classmethod
    def of_move(cls, move: Move, kv_bytes: int, replay_tokens: int) -> Migration:
        """Gives the migration of a packer's `move` with the costs the caller knows for its session."""
        return cls(move.session_id, move.src, move.dst, kv_bytes, replay_tokens)


class MigrationSplit(NamedTuple):
    """(kv_moves, replay_moves, deferred) of one epoch."""

    kv_moves: list[Migration]
    replay_moves: list[Migration]
    deferred: list[Migration]


def direct_link(src: str, dst: str) -> Hashable:
    """Gives the link of a migration when every (src, dst) pair has its own budget."""
    return (src, dst)


def _free_fraction(budget: float, used_after: float) -> float:
    return (budget - used_after) / budget if budget > 0 else 0.0


def split_migrations(
    migrations: Sequence[Migration],
    link_budget_bytes: Mapping[Hashable, float],
    replay_budget_tokens: Mapping[str, float],
    link_of: Callable[[str, str], Hashable] = direct_link,
) -> MigrationSplit:
    """Splits an epoch's migrations into KV transfers, token replays and deferred ones, within both budgets."""
    used_bytes: dict[Hashable, float] = {}
    used_tokens: dict[str, float] = {}
    split = MigrationSplit([], [], [])
    for migration in sorted(migrations, key=lambda m: (-m.kv_bytes, m.session_id, m.src, m.dst)):
        link = link_of(migration.src, migration.dst)
        byte_budget = link_budget_bytes.get(link, 0)
        token_budget = replay_budget_tokens.get(migration.dst, 0)
        bytes_after = used_bytes.get(link, 0) + migration.kv_bytes
        tokens_after = used_tokens.get(migration.dst, 0) + migration.replay_tokens
        kv_ok, replay_ok = bytes_after <= byte_budget, tokens_after <= token_budget
        if kv_ok and replay_ok:
            kv_ok = _free_fraction(byte_budget, bytes_after) >= _free_fraction(token_budget, tokens_after)
            replay_ok = not kv_ok
        if kv_ok:
            used_bytes[link] = bytes_after
            split.kv_moves.append(migration)
        elif replay_ok:
            used_tokens[migration.dst] = tokens_after
            split.replay_moves.append(migration)
        else:
            split.deferred.append(migration)
    return split


@dataclass(frozen=True)
class MigrationCosts:
    """What moving a session costs by either mode, and the budgets of one epoch (spec section 6, item 12).

    `kv_bytes_per_token` is the session's KV for all the blocks that move, per token. A KV transfer takes its bytes
    over the link (`transfer_seconds`: at the link's rate, or ramping up as TCP's slow start does) plus
    `kv_round_trips` RTTs: one when the bytes stream (`chunk_bytes` 0, the simulator's model), or
    one per chunk plus the open and the commit when each chunk waits for its reply (the live servers). A replay takes
    the destination's prefill of the tokens, plus `replay_round_trips` RTTs and the upload of the inputs the client
    re-sends (`replay_bytes_per_token`, hidden states) over the same link.
    """

    kv_bytes_per_token: int
    bandwidth_bytes_per_s: float
    rtt_s: float
    prefill_s_per_token: float
    epoch_s: float
    comm_budget_share: float = 0.5
    comp_budget_share: float = 0.25
    chunk_bytes: int = 0
    replay_bytes_per_token: int = 0
    replay_round_trips: int = 0
    initial_window_bytes: int = 0  # 0: bytes flow at the link's rate at once; else TCP slow start from this window

    @property
    def link_budget_bytes(self) -> float:
        return self.comm_budget_share * self.bandwidth_bytes_per_s * self.epoch_s

    @property
    def replay_budget_tokens(self) -> float:
        return self.comp_budget_share * self.epoch_s / self.prefill_s_per_token

    def fits_no_budget(self, migration: Migration) -> bool:
        """Gives whether `migration` exceeds both budgets even with nothing else in its epoch (it would wait for ever:
        such a move runs on its own, by the mode that ends first)."""
        return migration.kv_bytes > self.link_budget_bytes and migration.replay_tokens > self.replay_budget_tokens

    def kv_round_trips(self, tokens: int) -> int:
        if self.chunk_bytes <= 0:
            return 1
        return math.ceil(tokens * self.kv_bytes_per_token / self.chunk_bytes) + 2

    def transfer_seconds(self, nbytes: float) -> float:
        """Gives the time `nbytes` take over the link: with slow start, a window of `initial_window_bytes` doubles
        every RTT until it fills the link (bandwidth x RTT), and the rest flows at the link's rate."""
        rate = self.bandwidth_bytes_per_s
        if self.initial_window_bytes <= 0 or self.rtt_s <= 0:
            return nbytes / rate
        seconds, sent, window = 0.0, 0.0, float(self.initial_window_bytes)
        while sent < nbytes and window < rate * self.rtt_s:
            sent, window, seconds = sent + window, 2 * window, seconds + self.rtt_s
        return seconds + max(0.0, nbytes - sent) / rate

    def kv_seconds(self, tokens: int) -> float:
        return self.transfer_seconds(tokens * self.kv_bytes_per_token) + self.rtt_s * self.kv_round_trips(tokens)

    def replay_seconds(self, tokens: int) -> float:
        upload_s = self.transfer_seconds(tokens * self.replay_bytes_per_token) if self.replay_bytes_per_token else 0.0
        return tokens * self.prefill_s_per_token + upload_s + self.rtt_s * self.replay_round_trips


Mode = Literal["kv", "replay"]


def choose_mode(costs: MigrationCosts, tokens: int, src: str = "src", dst: str = "dst") -> Mode:
    """Gives the mode of one move of a session holding `tokens` tokens, on its own in its epoch.

    The move's whole time in each mode is counted against that budget, round trips included: each budget is the
    time its share of the epoch gives (bytes / bandwidth, tokens x prefill time are the same budgets in seconds), in
    nanoseconds. With equal budget shares this picks the mode that ends first."""
    kv_s, replay_s = costs.kv_seconds(tokens), costs.replay_seconds(tokens)
    migration = Migration("session", src, dst, round(kv_s * 1e9), round(replay_s * 1e9))
    split = split_migrations([migration], {(src, dst): costs.comm_budget_share * costs.epoch_s * 1e9},
                             {dst: costs.comp_budget_share * costs.epoch_s * 1e9})
    if split.kv_moves:
        return "kv"
    if split.replay_moves:
        return "replay"
    return "kv" if kv_s <= replay_s else "replay"  # too large for one epoch either way: the one that ends first


KV_CHUNK_BYTES = 4 << 20  # keys and values one import_kv frame of the live servers carries at most
DEFAULT_LINK_MBPS = 100.0  # a link's bandwidth before anything was measured on it
EPOCH_S = 1.0
TCP_INITIAL_WINDOW = 10 * 1460  # bytes a fresh (or idle) TCP connection sends in its first round trip (Linux)
BUDGET_SHARE = 0.5  # of an epoch, for the link's bytes and for the destination's replay prefill alike


def announced_bytes_per_s(*measured_mbps: float | None) -> float:
    """Gives a link's bandwidth from its ends' measured inbound throughput (the lower), else DEFAULT_LINK_MBPS."""
    rates = [mbps for mbps in measured_mbps if mbps]
    return (min(rates) if rates else DEFAULT_LINK_MBPS) * 1e6 / 8


def move_costs(*, kv_bytes_per_token: int, bandwidth_bytes_per_s: float, rtt_s: float, prefill_s_per_token: float,
               replay_bytes_per_token: int, chunk_bytes: int = KV_CHUNK_BYTES, epoch_s: float = EPOCH_S
               ) -> MigrationCosts:
    """Gives the costs of moving one session by either mode, as this server's migrations run: chunks of at most
    `chunk_bytes` each wait for their reply, and a replay costs the client two round trips (the step that learns
    of the move, the open at the destination) and the upload of its saved inputs; both ramp up from TCP's
    initial window (a move's connection is new, or idle long enough for Linux to restart slow start)."""
    return MigrationCosts(
        kv_bytes_per_token, bandwidth_bytes_per_s, rtt_s, prefill_s_per_token, epoch_s,
        comm_budget_share=BUDGET_SHARE, comp_budget_share=BUDGET_SHARE, chunk_bytes=chunk_bytes,
        replay_bytes_per_token=replay_bytes_per_token, replay_round_trips=2, initial_window_bytes=TCP_INITIAL_WINDOW,
    )
