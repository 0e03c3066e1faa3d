"""Turning a new placement into block moves on a running swarm: few blocks moved, every block served meanwhile.

- Roles: GBP-CR places servers by their speed and memory, so similar servers (memory that holds as many blocks,
  about the same time per block) are interchangeable within a placement. `match_roles` hands each role (a block
  range) to a similar server whose current range overlaps it most, so that as few blocks as possible are loaded
  anew. The chains are then allocated (GCA) over the ranges as handed out.
- Order: a server that changes its range stops taking new sessions on the blocks it leaves at once, so a block
  stays served only while another server serves it. `move_order` applies first the moves whose leaving blocks are
  served elsewhere, updating the coverage after each; moves that would leave a block unserved go last, those that
  uncover fewest first (the block is unserved only while that one server loads).

Pure: ranges in (0-based, end exclusive, as servers announce them), ranges and an order out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from orchestrator.swarm_model import Placement

Range = tuple[int, int]


def placement_ranges(placement: Placement) -> dict[str, Range]:
    """Gives each hosting server's range of `placement` 0-based and end exclusive: (a_j - 1, a_j - 1 + m_j)."""
    return {name: (first - 1, first - 1 + count) for name, (first, count) in placement.blocks.items() if count > 0}


def overlap(first: Range | None, second: Range) -> int:
    """Gives how many blocks two ranges share."""
    if first is None:
        return 0
    return max(0, min(first[1], second[1]) - max(first[0], second[0]))


def match_roles(
    target: Mapping[str, Range], current: Mapping[str, Range], similar: Callable[[str, str], bool]
) -> dict[str, Range]:
    """Gives `target`'s ranges handed out again: each server may take the role placed on a server `similar` to it,
    and takes the one that keeps most of its current blocks (greedy: the largest overlap first; ties by name).
    A server left without a similar role keeps its own. Servers `target` leaves out stay out."""
    holders = sorted(target)
    pairs = sorted(
        ((overlap(current.get(name), target[holder]), name, holder)
         for name in holders for holder in holders if name == holder or similar(name, holder)),
        key=lambda pair: (-pair[0], pair[1] != pair[2], pair[1], pair[2]),
    )
    result: dict[str, Range] = {}
    taken: set[str] = set()
    for _, name, holder in pairs:
        if name not in result and holder not in taken:
            result[name] = target[holder]
            taken.add(holder)
    for name in holders:  # the greedy pass left it no similar role: it takes a free one, its own first
        if name not in result:
            holder = name if name not in taken else next(h for h in holders if h not in taken)
            result[name] = target[holder]
            taken.add(holder)
    return result


def blocks_moved(current: Mapping[str, Range], target: Mapping[str, Range]) -> int:
    """Gives how many blocks the servers must load to go from `current` to `target`."""
    return sum(
        (new[1] - new[0]) - overlap(current.get(name), new) for name, new in target.items() if current.get(name) != new
    )


def move_order(current: Mapping[str, Range], target: Mapping[str, Range], num_blocks: int) -> list[str]:
    """Gives the servers whose range changes, in the order that keeps every block served as long as possible."""
    serving = dict(current)
    pending = sorted(name for name, new in target.items() if current.get(name) != new)
    order: list[str] = []

    def uncovered(name: str) -> int:
        """Gives the blocks served by no one while `name` moves (it serves only what both its ranges share)."""
        new, old = target[name], serving.get(name)
        kept = (max(new[0], old[0]), min(new[1], old[1])) if old else (0, 0)
        others = [span for peer, span in serving.items() if peer != name]
        count = 0
        for block in range(num_blocks):
            served_before = any(start <= block < end for start, end in serving.values())
            served_during = kept[0] <= block < kept[1] or any(start <= block < end for start, end in others)
            count += served_before and not served_during
        return count

    while pending:
        name = min(pending, key=lambda peer: (uncovered(peer), peer))
        pending.remove(name)
        order.append(name)
        serving[name] = target[name]
    return order
