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
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

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
