"""Operation batching (Sec. VI-C, spec 3.4): an epoch's Departs, then its Updates, then its Allocates, with the moves
they cause kept in a buffer and pruned before anything moves.

The packer plans as it goes (its state follows every buffered move); only the pruned buffer is executed:
- a chain r: a -> b -> c becomes one move a -> c, and r: a -> ... -> a no move at all;
- a session that departs in the epoch moves nowhere, and one that arrives in the epoch is placed at its final bin
  (a placement, not a migration) [inferred];
- every other session keeps its final bin.
Pruning only removes moves, so the epoch never migrates more than the same operations run one by one in the same
order, and the packer ends in the same state either way. Works with any `Packer`.

The operations of one epoch name distinct sessions (Algorithm 1 gives a session at most one operation per slot); a
caller whose epoch spans several slots merges them first: an arrival with its latest size, an arrival and a departure
in the same epoch cancel [chosen]. Within each kind, operations keep their given order. An operation that raises
(e.g. NoFreeBin) leaves the ones before it applied.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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


def prune_moves(moves: Sequence[Move], departed: Iterable[str] = (), arrived: Iterable[str] = ()) -> list[Move]:
    """Gives one net move per session (first source to last destination), in the order sessions first moved.

    Drops sessions that end where they began, and those in `departed` or `arrived`.
    """
    dropped = set(departed) | set(arrived)
    first: dict[str, Move] = {}
    last: dict[str, Move] = {}
    for move in moves:
        first.setdefault(move.session_id, move)
        last[move.session_id] = move
    net = []
    for session_id, start in first.items():
        end = last[session_id]
        if session_id not in dropped and start.src != end.dst:
            net.append(Move(session_id, start.src, end.dst, end.pages, start.unit_id))
    return net


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
    return EpochPlan(prune_moves(buffered, departed, arrived), buffered)
