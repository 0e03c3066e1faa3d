"""Victims of a drop (Sec. 4.2, spec 3.5 and 5.4): the sessions running on a member when it drops blocks, whose KV
for those blocks must reach the buddy that keeps them, in which order and by which mode.

Modes, by the victim's expected delay:
- `blocking`: the session's KV for the dropped blocks moves to the keeper while the session waits (the default);
- `live`: the session keeps decoding; for a block whose KV has not moved yet the keeper sends the attention inputs to
  the member that still holds the KV (`attend`), one round trip per pending block per token, so only while
  rtt x pending blocks stays within the session's slack between tokens (behind a flag, as spec 5.4 advises);
- `replay`: the client re-runs its saved inputs through the new chain, when the keeper's prefill ends before the
  bytes would have moved (MELL's rule for one move, `choose_mode`, on the same cost model).
Order (blocking): session by session, smallest KV first, which minimizes the victims' mean stall [chainswarm].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrator.buddy.records import DropPlan
from orchestrator.packing.migration_split import MigrationCosts, choose_mode

ExchangeMode = Literal["blocking", "live", "replay"]


@dataclass(frozen=True)
class VictimMove:
    """One victim's KV for the blocks [block_start, block_end) that `src` drops and `dst` keeps."""

    session_id: str
    src: str
    dst: str
    block_start: int
    block_end: int
    tokens: int
    kv_bytes: int


def victim_moves(
    plan: DropPlan, sessions: Mapping[str, Sequence[tuple[str, int]]], kv_bytes_per_token_block: int
) -> list[VictimMove]:
    """Gives the moves a plan asks of the sessions each server runs (`sessions`: peer -> (session id, tokens)): for
    every block range a member drops, the part each group-mate keeps."""
    moves = []
    for peer, running in sorted(sessions.items()):
        if peer not in plan.kept:
            continue
        group = plan.group_of(peer)
        for first, last in plan.dropped.get(peer, ()):
            for mate in group.members:
                keep_first, keep_last = plan.kept[mate]
                start, end = max(first, keep_first), min(last, keep_last)
                if mate == peer or start >= end:
                    continue
                for session_id, tokens in running:
                    kv_bytes = tokens * (end - start) * kv_bytes_per_token_block
                    moves.append(VictimMove(session_id, peer, mate, start, end, tokens, kv_bytes))
    return exchange_order(moves)


def incoming_pages(plan: DropPlan, served: Mapping[str, tuple[int, int]],
                   pages_kv: Mapping[str, int]) -> dict[str, int]:
    """Gives, for every member of `plan`, the KV pages its group-mates' victims are expected to move into it: each
    member that drops blocks it serves now (`served`) sends the KV it holds over them (`pages_kv`, spread evenly over
    the blocks it serves) to the mate that keeps them. A member holds that many of the pages its own drop freed back
    for them (spec 5.2's transient: the freed pages less the incoming KV are what new sessions may take at once)."""
    incoming = dict.fromkeys(plan.kept, 0.0)
    for peer, (first, last) in sorted(served.items()):
        if peer not in plan.kept or last <= first or not pages_kv.get(peer):
            continue
        keep_first, keep_last = plan.kept[peer]
        gone = [(first, min(last, keep_first)), (max(first, keep_last), last)]  # what it serves and drops now
        per_block = pages_kv[peer] / (last - first)
        for mate in plan.group_of(peer).members:
            if mate == peer or mate not in incoming:
                continue
            mate_first, mate_last = plan.kept[mate]
            blocks = sum(max(0, min(end, mate_last) - max(start, mate_first)) for start, end in gone)
            incoming[mate] += per_block * blocks
    return {peer: math.ceil(pages) for peer, pages in incoming.items()}


def exchange_order(moves: Sequence[VictimMove]) -> list[VictimMove]:
    """Gives `moves` session by session, the session with the least KV to move first (ties: session id), each
    session's moves in block order."""
    per_session: dict[str, int] = {}
    for move in moves:
        per_session[move.session_id] = per_session.get(move.session_id, 0) + move.kv_bytes
    return sorted(moves, key=lambda move: (per_session[move.session_id], move.session_id, move.block_start, move.dst))


def exchange_mode(
    costs: MigrationCosts, tokens: int, *, rtt_ms: float, pending_blocks: int, tbt_slack_ms: float,
    live: bool = False,
) -> ExchangeMode:
    """Gives how one victim's KV should reach its keeper: `costs` prices the move of its dropped blocks' KV (bytes
    per token over those blocks) and the keeper's replay of its `tokens`."""
    if choose_mode(costs, tokens) == "replay":
        return "replay"
    if live and rtt_ms * pending_blocks <= tbt_slack_ms:
        return "live"
    return "blocking"
