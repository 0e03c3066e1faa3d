"""Buddy groups (Sec. 4.1, spec 3.2 and 5.3): which servers of a segment merge, and which blocks each member keeps.

A group of k servers keeps one copy of the segment between them, member r a contiguous slice, so it frees the
parameter pages of every block a member does not keep: (k - 1) x P when all members are alike. Alg. 1 merges the
two smallest groups until the freed pages cover the requirement R; every merge frees one more P, so it makes
min(N - 1, ceil(R / P)) merges, pairs first, but for more than N / 2 merges its groups are not depth-balanced
(N = 8, 5 merges: {4, 2, 2} where {3, 3, 2} frees as much). In a swarm every member is a WAN hop, so the default is
the balanced variant: the fewest groups' worth of merges that covers R, with group sizes that differ by at most one.
`balanced=False` is the paper's greedy, for fidelity runs.

Two limits of a swarm's records [chainswarm]: a group has at most as many members as the segment has blocks (each
keeps at least one), and servers hosting partly overlapping ranges are not grouped (not built). Under the first, Alg.
1 stops when its two smallest groups would not fit in one, which can be short of the most it could free (6 servers
of a 3-block segment end as three pairs, where two groups of three free more); the balanced variant does not. Ties
are broken by peer id, so every server computing a plan from the same records gets the same plan.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence

from orchestrator.buddy.records import BuddyGroup, DropPlan, PlanError, PlanViolation, SegmentReplica


def segments(replicas: Iterable[SegmentReplica]) -> dict[tuple[int, int], list[SegmentReplica]]:
    """Gives the replicas of each hosted segment, in peer-id order: the servers a plan may group together."""
    by_segment: dict[tuple[int, int], list[SegmentReplica]] = {}
    for replica in replicas:
        by_segment.setdefault(replica.segment, []).append(replica)
    return {segment: sorted(group, key=lambda r: r.peer_id) for segment, group in sorted(by_segment.items())}


def slice_group(
    members: Sequence[SegmentReplica], *, by_speed: bool = False
) -> dict[str, tuple[int, int]]:
    """Gives each member's kept range: contiguous slices, in member order, that tile the segment.

    Equal slices (sizes differ by at most one, the first members taking the extra blocks) as the authors' code cuts
    them; with `by_speed`, slices proportional to 1 / tau_p_ms, so that faster servers keep more [chainswarm]. Every
    member keeps at least one block."""
    if not members:
        return {}
    start, end = members[0].segment
    blocks = end - start
    if len(members) > blocks:
        raise PlanError(f"{len(members)} members cannot each keep a block of a {blocks}-block segment")
    if by_speed:
        counts = _proportional([1.0 / member.tau_p_ms for member in members], blocks)
    else:
        counts = [blocks // len(members) + (1 if rank < blocks % len(members) else 0) for rank in range(len(members))]
    kept: dict[str, tuple[int, int]] = {}
    for member, count in zip(members, counts, strict=True):
        kept[member.peer_id] = (start, start + count)
        start += count
    return kept


def _proportional(weights: Sequence[float], total: int) -> list[int]:
    """Gives integer shares of `total` proportional to `weights`, at least one each (largest remainder; ties go to the
    earlier member)."""
    spare = total - len(weights)
    exact = [spare * weight / sum(weights) for weight in weights]
    counts = [1 + math.floor(share) for share in exact]
    by_remainder = sorted(range(len(weights)), key=lambda index: (-(exact[index] - math.floor(exact[index])), index))
    for index in by_remainder[: total - sum(counts)]:
        counts[index] += 1
    return counts


def _freed(members: Sequence[SegmentReplica], by_speed: bool) -> int:
    kept = slice_group(members, by_speed=by_speed)
    return sum((member.blocks - (kept[member.peer_id][1] - kept[member.peer_id][0])) * member.params_pages_per_block
               for member in members)


def plan_buddy_groups(
    replicas: Sequence[SegmentReplica], required_pages: int, *, balanced: bool = True, by_speed: bool = False
) -> list[BuddyGroup]:
    """Gives the buddy groups of servers hosting one segment that free at least `required_pages` (Alg. 1, or its
    balanced variant); singletons keep the whole segment. If no grouping frees enough, the one freeing the most."""
    replicas = _one_segment(replicas)
    if not replicas:
        return []
    if balanced:
        partition = _balanced(replicas, required_pages, by_speed)
    else:
        partition = _greedy(replicas, required_pages, by_speed)
    start, end = replicas[0].segment
    return [BuddyGroup(tuple(member.peer_id for member in group), start, end) for group in partition]


def _one_segment(replicas: Sequence[SegmentReplica]) -> list[SegmentReplica]:
    if len({replica.peer_id for replica in replicas}) != len(replicas):
        raise PlanError("a server appears twice among the replicas")
    if len({replica.segment for replica in replicas}) > 1:
        raise PlanError(f"replicas of different segments cannot be grouped: {sorted({r.segment for r in replicas})}")
    return sorted(replicas, key=lambda replica: replica.peer_id)


def _greedy(replicas: list[SegmentReplica], required_pages: int, by_speed: bool) -> list[list[SegmentReplica]]:
    """Alg. 1 exactly: pop the smallest group and the next smallest, merge the second into the first, push it back,
    while more than one group is left and the groups free less than required."""
    groups = [[replica] for replica in replicas]
    heap = [(1, index) for index in range(len(groups))]  # (size, index): equal sizes pop in peer-id order
    freed = 0
    max_members = replicas[0].blocks
    while len(heap) > 1 and freed < required_pages:
        size, first = heapq.heappop(heap)
        other_size, second = heapq.heappop(heap)
        if size + other_size > max_members:  # the two smallest are too many already: so is every other pair
            heapq.heappush(heap, (size, first))
            heapq.heappush(heap, (other_size, second))
            break
        freed -= _freed(groups[first], by_speed) + _freed(groups[second], by_speed)
        groups[first] += groups[second]
        groups[second] = []
        freed += _freed(groups[first], by_speed)
        heapq.heappush(heap, (size + other_size, first))
    return [groups[index] for _, index in sorted(heap, key=lambda item: item[1])]


def _balanced(replicas: list[SegmentReplica], required_pages: int, by_speed: bool) -> list[list[SegmentReplica]]:
    """The most groups (the fewest merges) whose balanced partition frees the required pages; sizes differ by at
    most one, members are consecutive in peer-id order."""
    fewest = math.ceil(len(replicas) / replicas[0].blocks)
    partition = _partition(replicas, len(replicas))
    for count in range(len(replicas), fewest - 1, -1):
        partition = _partition(replicas, count)
        if sum(_freed(group, by_speed) for group in partition) >= required_pages:
            break
    return partition


def _partition(replicas: list[SegmentReplica], count: int) -> list[list[SegmentReplica]]:
    size, larger = divmod(len(replicas), count)
    groups, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < larger else 0)
        groups.append(replicas[start:end])
        start = end
    return groups


def plan_drop(
    replicas: Sequence[SegmentReplica], required_pages: int, *, balanced: bool = True, by_speed: bool = False,
    epoch: int = 0,
) -> DropPlan:
    """Gives the drop plan of one segment's servers: their buddy groups, the range each keeps, the ranges it drops
    and the pages that frees. Draining servers take no part: they are leaving, so no block may depend on them."""
    replicas = _one_segment(replicas)
    if not replicas:
        raise PlanError("a drop plan needs at least one replica")
    active = [replica for replica in replicas if not replica.draining]
    by_peer = {replica.peer_id: replica for replica in active}
    groups = plan_buddy_groups(active, required_pages, balanced=balanced, by_speed=by_speed)
    kept: dict[str, tuple[int, int]] = {}
    for group in groups:
        kept.update(slice_group([by_peer[peer] for peer in group.members], by_speed=by_speed))
    return _plan(replicas[0].segment, groups, kept, by_peer, required_pages, epoch)


def _plan(segment: tuple[int, int], groups: Sequence[BuddyGroup], kept: Mapping[str, tuple[int, int]],
          by_peer: Mapping[str, SegmentReplica], required_pages: int, epoch: int) -> DropPlan:
    """Gives the plan of these groups and kept ranges: what each server drops of the segment, and the pages that
    frees."""
    start, end = segment
    dropped = {peer: tuple(part for part in ((start, first), (last, end)) if part[0] < part[1])
               for peer, (first, last) in kept.items()}
    freed = {peer: sum(last - first for first, last in parts) * by_peer[peer].params_pages_per_block
             for peer, parts in dropped.items()}
    return DropPlan(start, end, tuple(groups), kept, freed, required_pages, epoch, dropped)


def groups_of(replicas: Sequence[SegmentReplica], kept: Mapping[str, tuple[int, int]]) -> list[list[str]] | None:
    """Gives the buddy groups that the kept ranges of one segment's servers form, each in slice order: a server that
    keeps the whole segment alone, the others as chains of slices that tile it (the next slice taken from the server
    with the smallest peer id that starts where the chain ends). None when the slices tile no set of chains (records
    that lag behind a drop). Which servers a chain pairs does not matter: a session's KV is wherever its blocks
    are, so any tiling is a valid grouping for a further merge."""
    replicas = _one_segment(replicas)
    if not replicas:
        return []
    start, end = replicas[0].segment
    groups = [[replica.peer_id] for replica in replicas if kept[replica.peer_id] == (start, end)]
    slices = sorted((kept[r.peer_id], r.peer_id) for r in replicas if kept[r.peer_id] != (start, end))
    while slices:
        chain, cursor = [], start
        while cursor < end:
            found = next((index for index, ((first, _), _) in enumerate(slices) if first == cursor), None)
            if found is None:
                return None
            (_, cursor), peer = slices.pop(found)
            chain.append(peer)
        groups.append(chain)
    return sorted(groups, key=lambda group: group[0])


def plan_merge(
    replicas: Sequence[SegmentReplica], groups: Sequence[Sequence[str]], kept: Mapping[str, tuple[int, int]],
    required_pages: int, *, epoch: int = 0,
) -> DropPlan:
    """Gives the plan of a deeper drop: Alg. 1 continued from the groups a segment's servers form now (`groups`,
    each in slice order, whole servers alone, `kept` their ranges). It merges the two smallest groups (ties: the
    first members' peer ids) until the merges free `required_pages` more than the groups free now, or until the two
    smallest would not fit in one (every member keeps a block) or a member would need a block it dropped. Members
    of a merged group keep a part of what they keep now, so that no block has to be loaded back: the new slices
    refine the old ones (`_refined_slices`), equal as far as that allows. Groups with a draining server are left as
    they are. The plan's kept ranges, freed pages and dropped ranges count from the whole segment, as `plan_drop`'s
    do [chainswarm: the paper plans once per burst from whole instances; in a swarm a burst that outgrows every
    pair would otherwise queue although merging pairs frees one more copy per merge]."""
    replicas = _one_segment(replicas)
    if not replicas:
        raise PlanError("a merge plan needs at least one replica")
    by_peer = {replica.peer_id: replica for replica in replicas}
    if sorted(peer for group in groups for peer in group) != sorted(by_peer):
        raise PlanError("the groups must hold every replica of the segment exactly once")
    kept = dict(kept)
    mergeable = [list(group) for group in groups if not any(by_peer[peer].draining for peer in group)]
    fixed = [list(group) for group in groups if any(by_peer[peer].draining for peer in group)]
    blocks = replicas[0].blocks
    freed_before = _freed_of(kept, by_peer)
    heap = [(len(group), group[0], group) for group in mergeable]
    heapq.heapify(heap)
    while len(heap) > 1 and _freed_of(kept, by_peer) - freed_before < required_pages:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        members = first[2] + second[2]
        slices = _refined_slices([by_peer[peer] for peer in members], kept) if len(members) <= blocks else None
        if slices is None:  # the two smallest cannot merge: no other two can merge into fewer members
            heapq.heappush(heap, first)
            heapq.heappush(heap, second)
            break
        kept.update(slices)
        merged = sorted(members, key=lambda peer: kept[peer])
        heapq.heappush(heap, (len(merged), merged[0], merged))
    final = sorted([group for _, _, group in heap] + fixed, key=lambda group: group[0])
    start, end = replicas[0].segment
    return _plan((start, end), [BuddyGroup(tuple(group), start, end) for group in final], kept, by_peer,
                 required_pages, epoch)


def _freed_of(kept: Mapping[str, tuple[int, int]], by_peer: Mapping[str, SegmentReplica]) -> int:
    return sum((replica.blocks - (kept[peer][1] - kept[peer][0])) * replica.params_pages_per_block
               for peer, replica in by_peer.items())


def _refined_slices(
    members: Sequence[SegmentReplica], kept: Mapping[str, tuple[int, int]]
) -> dict[str, tuple[int, int]] | None:
    """Gives contiguous slices that tile the segment, one per member, each inside what the member keeps now, as equal
    as that allows (earlier slices take the extra blocks); None if there are none. Members go in order of what they
    keep (ties: peer id); each slice ends at an equal share of the blocks left, moved no earlier than where the next
    member's kept range starts and no later than where its own ends or where a member after it would find no block
    of its own left."""
    order = sorted(members, key=lambda member: (kept[member.peer_id], member.peer_id))
    start, end = order[0].segment
    cursor, slices = start, {}
    for index, member in enumerate(order):
        first, last = kept[member.peer_id]
        left = len(order) - index
        if not first <= cursor < last:
            return None
        if left == 1:
            if last < end:
                return None
            slices[member.peer_id] = (cursor, end)
            break
        low = max(cursor + 1, kept[order[index + 1].peer_id][0])
        high = min([last, end - (left - 1)] + [kept[later.peer_id][1] - ahead
                                                for ahead, later in enumerate(order[index + 1:], start=1)])
        if low > high:
            return None
        cut = min(max(cursor + math.ceil((end - cursor) / left), low), high)
        slices[member.peer_id] = (cursor, cut)
        cursor = cut
    return slices


def check_plan(plan: DropPlan, replicas: Sequence[SegmentReplica]) -> None:
    """Raises `PlanViolation` unless: every non-draining replica is in exactly one group and no draining one in any;
    each group's kept slices are contiguous, non-empty, in member order and tile the segment; the freed pages are
    exactly the dropped blocks' parameter pages; every block stays kept by at least one non-draining server."""
    by_peer: Mapping[str, SegmentReplica] = {replica.peer_id: replica for replica in replicas}
    active = sorted(peer for peer, replica in by_peer.items() if not replica.draining)
    members = sorted(peer for group in plan.groups for peer in group.members)
    if members != active:
        raise PlanViolation(f"groups hold {members}, the non-draining replicas are {active}")
    for group in plan.groups:
        cursor = plan.block_start
        for peer in group.members:
            first, last = plan.kept[peer]
            if first != cursor or last <= first:
                raise PlanViolation(f"{peer} keeps [{first}, {last}); its slice should start at {cursor}")
            replica = by_peer[peer]
            if not replica.block_start <= first < last <= replica.block_end:
                raise PlanViolation(f"{peer} keeps [{first}, {last}) outside its hosted {replica.segment}")
            dropped_blocks = replica.blocks - (last - first)
            if plan.freed_pages[peer] != dropped_blocks * replica.params_pages_per_block:
                raise PlanViolation(f"{peer} frees {plan.freed_pages[peer]} pages for {dropped_blocks} dropped blocks")
            cursor = last
        if cursor != plan.block_end:
            raise PlanViolation(f"group {group.members} keeps blocks up to {cursor}, not {plan.block_end}")
    if active:
        covered = [0] * (plan.block_end - plan.block_start)
        for peer in active:
            first, last = plan.kept[peer]
            for block in range(first, last):
                covered[block - plan.block_start] += 1
        if min(covered) < 1:
            raise PlanViolation(f"block {plan.block_start + covered.index(0)} would be left without an online host")
