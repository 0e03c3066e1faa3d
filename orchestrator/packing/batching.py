"""Operation batching (Sec. VI-C, spec 3.4): an epoch's Departs, then its Updates, then its Allocates, with the moves
they cause kept in a buffer and pruned before anything moves.

The packer plans as it goes (its state follows every buffered move); only the pruned buffer is executed:
- a chain r: a -> b -> c becomes one move a -> c, and r: a -> ... -> a no move at all;
- a session that departs in the epoch moves nowhere, and one that arrives in the epoch is placed at its final bin
  (a placement, not a migration) [inferred];
- units of one class trade bins where that brings a session back to where it began the epoch (`keep_in_place`):
  a departure's refill pulled r from a to fill a hole on b, an arrival of r's class then landed on a, so the arrival
  takes the hole and r stays [chosen: the paper's step 3, "check B and remove unnecessary movement" after the
  Allocates, read across sessions; the chain rules alone removed 1-6% of MELL's moves at 1-s epochs];
- every other session keeps its final bin.
Batching only removes moves: an epoch never migrates more than the same operations run one by one in the same order
(pruned or not). The trades leave the same sessions on the same active bins, each bin with the same classes, and
the packing as valid as before (`Packer.exchange` refuses any trade that breaks what the packer promises); which
sessions share a bin differs, so later epochs may plan differently from a run without batching. Works with any
`Packer`.

The operations of one epoch name distinct sessions (Algorithm 1 gives a session at most one operation per slot); a
caller whose epoch spans several slots merges them first: an arrival with its latest size, an arrival and a departure
in the same epoch cancel [chosen]. Within each kind, operations keep their given order. An operation that raises
(e.g. NoFreeBin) leaves the ones before it applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.packing.records import Item, Move, Packer


@dataclass(frozen=True)
class Allocate:
    """A session arrives."""

    item: Item


@dataclass(frozen=True)
class Depart:
    """A session completes."""

    item_id: str


@dataclass(frozen=True)
class Update:
    """A running session grew to `new_pages`."""

    item_id: str
    new_pages: int


Operation = Allocate | Depart | Update


@dataclass(frozen=True)
class EpochPlan:
    """What an epoch executes (`moves`) and what running its operations one by one would have moved."""

    moves: list[Move]
    unbatched_moves: list[Move]


def session_of(operation: Operation) -> str:
    """Gives the session an operation is about."""
    return operation.item.item_id if isinstance(operation, Allocate) else operation.item_id


def epoch_order(operations: Iterable[Operation]) -> list[Operation]:
    """Gives the operations in batching order: Departs, then Updates, then Allocates, each kind in its given order."""
    rank = {Depart: 0, Update: 1, Allocate: 2}
    return sorted(operations, key=lambda operation: rank[type(operation)])


def apply_operation(packer: Packer, operation: Operation) -> list[Move]:
    """Runs one operation on `packer`; gives the moves it causes."""
    if isinstance(operation, Allocate):
        return packer.allocate(operation.item)
    if isinstance(operation, Depart):
        return packer.depart(operation.item_id)
    return packer.update(operation.item_id, operation.new_pages)


def origins_of(packer: Packer, moves: Sequence[Move], departed: Iterable[str] = (), arrived: Iterable[str] = ()
               ) -> dict[str, str]:
    """Gives where each running session was when the epoch began: the source of its first move, else its bin.
    Sessions in `arrived` (placed freshly) and `departed` have none."""
    absent = set(departed) | set(arrived)
    origins = {session_id: bin_id for session_id, bin_id in packer.assignment().items() if session_id not in absent}
    for move in reversed(moves):
        if move.session_id in origins:
            origins[move.session_id] = move.src
    return origins


def keep_in_place(packer: Packer, origins: Mapping[str, str]) -> int:
    """Exchanges units between bins (`Packer.exchange`) while that brings more sessions back to their origin than
    it takes away; gives the exchanges made. A session without an origin (just arrived) lands anywhere for free.

    This is step 3's "check B and remove unnecessary movement" across sessions [chosen]: when a departure pulled a
    unit r from bin a to fill a hole on bin b and an arrival of r's class then landed on a, the arrival takes the
    hole and r stays. The packing keeps every bin's classes and invariants (`exchange` refuses otherwise); each
    exchange strictly lowers the moves, so the loop ends.
    """

    def cost(members: Sequence[str], bin_id: str) -> int:  # the sessions of a unit on `bin_id` that moved there
        return sum(1 for s in members if s in origins and origins[s] != bin_id)

    def members_of(session_id: str) -> tuple[str, ...]:
        unit = packer.unit_of(session_id)
        return tuple(s for s in packer.sessions_on(packer.bin_of(session_id)) if packer.unit_of(s) == unit)

    exchanges = 0
    while True:
        away = sorted(s for s, origin in origins.items() if packer.bin_of(s) != origin)
        if not _exchange_one(packer, away, origins, cost, members_of):
            return exchanges
        exchanges += 1


def _exchange_one(packer: Packer, away: Sequence[str], origins: Mapping[str, str],
                  cost: Callable[[Sequence[str], str], int], members_of: Callable[[str], tuple[str, ...]]) -> bool:
    """Makes the first exchange that lowers the moves, trying the sessions `away` in order; tells whether it did."""
    for session_id in away:
        here, members = packer.bin_of(session_id), members_of(session_id)
        for origin in sorted({origins[s] for s in members if s in origins} - {here}):
            seen: set[str] = set()
            for other in packer.sessions_on(origin):
                unit = packer.unit_of(other)
                if unit in seen:
                    continue
                seen.add(unit)
                others = members_of(other)
                gain = cost(members, here) + cost(others, origin) - cost(members, origin) - cost(others, here)
                if gain > 0 and packer.exchange(session_id, other):
                    return True
    return False


def net_moves(packer: Packer, origins: Mapping[str, str], order: Sequence[str] = ()) -> list[Move]:
    """Gives one move per session that ends away from its origin (a chain a -> b -> c is one move a -> c, a round
    trip none): the sessions in the order they first appear in `order`, then the others by id."""
    rank: dict[str, int] = {}
    for session_id in order:
        rank.setdefault(session_id, len(rank))
    away = [s for s, origin in origins.items() if packer.bin_of(s) != origin]
    return [Move(s, origins[s], packer.bin_of(s), packer.pages_of(s), packer.unit_of(s))
            for s in sorted(away, key=lambda s: (rank.get(s, len(rank)), s))]


def batch_operations(packer: Packer, operations: Sequence[Operation]) -> EpochPlan:
    """Runs one epoch's operations on `packer` in batching order; gives the pruned moves to execute."""
    sessions = [session_of(operation) for operation in operations]
    if len(set(sessions)) != len(sessions):
        raise ValueError("an epoch holds at most one operation per session: merge them first")
    buffered: list[Move] = []
    for operation in epoch_order(operations):
        buffered.extend(apply_operation(packer, operation))
    departed = [op.item_id for op in operations if isinstance(op, Depart)]
    arrived = [op.item.item_id for op in operations if isinstance(op, Allocate)]
    return EpochPlan(settled_moves(packer, buffered, departed, arrived), buffered)


def settled_moves(packer: Packer, buffered: Sequence[Move], departed: Iterable[str] = (),
                  arrived: Iterable[str] = (), present: Mapping[str, str] | None = None) -> list[Move]:
    """Gives the epoch's moves to execute: each session's net move from where it began the epoch, after
    `keep_in_place` exchanged what it could; sessions that departed or arrived in the epoch move nowhere.

    `present` names where sessions really are when that is not where the packer had them (a move planned in an
    earlier epoch that has not started yet): the exchanges aim at those servers, and the moves stay relative to
    the packer's bins (a move back cancels the waiting one)."""
    origins = origins_of(packer, buffered, departed, arrived)
    keep_in_place(packer, origins | {s: where for s, where in (present or {}).items() if s in origins})
    return net_moves(packer, origins, [m.session_id for m in buffered])
