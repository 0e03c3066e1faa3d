"""MELL's online KV packing (Fig. 10 of the paper, spec 3.2): Allocate, Depart and Update with bounded migrations.

Sessions are items of L, M, S, T or tiny class (`classes`); tiny ones travel in multi-items, which count as T. A bin
is labelled by the highest class on it. The packing kept is the one of Theorem 1 (`invariant_violations`): an M-bin
holds two M's (and T's), an S-bin three S's, a T-bin is >= 75% full, an L-bin without an S/M has no S/M on an S/M-bin
that would fit beside its L, and while T-bins exist every L- and M-bin is >= 75% full. The newest bin of each label
is exempt (MELL's "constant number of exceptions": it is the one left partly filled).

Read from the paper: T's go to the L-bin of highest prio(j) that fits, else the newest T-bin; S/M's to the L-bin of
highest prio(j) with S_L + S_i < C (its T's make room), else the newest bin of their own class; an L opens a bin and
pulls an S/M from the S/M-bin of highest prio(j -> j'), which is refilled from the newest bin of its class; a
departure refills its bin from the newest bin of the same label; an L's departure re-allocates everything beside it;
growth across classes is Depart + Allocate, except M -> L on an M-bin, which stays (its neighbours leave on overload).

Rules the paper leaves open, chosen here (spec 3.2 and 6 where it has one):
- "S/M" means class-matched pools: an M goes to the newest M-bin holding < 2 M's, an S to the newest S-bin holding
  < 3 S's, else a new bin [inferred]; a T that fits no L-bin nor the newest T-bin opens a new bin [inferred].
- T's also fill M-bins that hold two M's and are below 75% (property 5 asks M-bins to be >= 75% while T-bins exist,
  which only T's can do; "an M-GPU holds two M's, possibly one T") [chosen].
- A departure or a growth that leaves an L-bin, M-bin or T-bin below 75% while T-bins exist pulls T's from the newest
  T-bin, largest first, until it is >= 75% (properties 3 and 5); a whole T leaving an L- or T-bin also pulls one T if
  one fits, as Fig. 10 says [chosen: Fig. 10 moves one T, which cannot keep properties 3 and 5]. Fig. 10's "newest
  T/M-GPU" as the source is read as the newest T-bin: the T's of M-bins stay, property 5 needs them [inferred].
- Which S/M an L-bin pulls: from the S/M-bin of highest prio(j -> j'), the largest S/M there with S_L + S < C;
  refills take the largest unit of the class; evictions for room take the largest T first (fewest moves) [inferred].
- A T displaced to make room for an S/M leaves only as needed, not every T on the bin as Fig. 10 says [chosen].
- Fig. 10's "departure from the most recently activated GPU: just remove" is not a separate rule: refilling a bin
  from the newest bin of its label is a no-op when it is that bin. It is not a blanket skip, because a skip that
  changes the bin's label (an L leaving S/M or T's behind) or leaves an L-bin without S/M would break Theorem 1 for
  the bin that was the newest of that label before [chosen].
- A bin whose label drops because its top-class unit left (an L departing, the last M of an M-bin that also holds
  T's leaving) re-allocates everything left on it and is released (Fig. 10 for L; the same rule for M) [inferred].
- Update runs Depart + Allocate as "take the item off, Allocate it preferring its own bin, then repair the bin it
  left", so an item whose own bin is a valid Allocate target does not move [chosen: fewer migrations].
- Overload by growth without a class change (spec 6.5), or M -> L / L -> L on its bin: units of lower class than the
  grown one leave, T's first and largest first; a grown S/M beside an L, or a grown T, with nothing smaller to evict,
  moves itself [inferred].
- Multi-items: a tiny session is placed like a T of its own size and joins a multi-item on that bin if one has room
  within C/4 (the smallest first), else starts one; two multi-items of <= C/8 on one bin merge in place (no move), so
  a bin holds at most one; a tiny that grows past C/8 leaves its multi-item and stays on its bin as a T (or moves as
  Update says for S, M, L); one whose multi-item would exceed C/4 starts its own on the same bin [inferred].
- A bin emptied and reused within one operation (an item alone on its bin that changes class) is stamped as newly
  activated; a new bin is the first inactive one in the given order [chosen].
- prio(j) and prio(j -> j') are those of `priority` (spec 5.4); ties go to the smallest bin id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from orchestrator.packing.bins import BinPacker
from orchestrator.packing.classes import (
    SizeClass,
    at_least_three_quarters,
    class_rank,
    fits_multi_item,
    is_incomplete_multi_item,
    size_class,
)
from orchestrator.packing.priority import PriorityWeights, bin_priority, rtt_between
from orchestrator.packing.records import Item

L, M, S, T, TINY = SizeClass.L, SizeClass.M, SizeClass.S, SizeClass.T, SizeClass.TINY
_PER_BIN = {M: 2, S: 3}  # a full M-bin holds two M's, a full S-bin three S's (Theorem 1, properties 1 and 2)
_NONE: frozenset[str] = frozenset()


class MellPacker(BinPacker):
    """MELL's Allocate / Depart / Update over bins of `capacity_pages` pages; every call gives the moves it causes."""

    name = "mell"

    def __init__(
        self,
        bin_ids: Sequence[str],
        capacity_pages: int,
        weights: PriorityWeights | None = None,
        rtt_ms: Mapping[tuple[str, str], float] | None = None,
    ) -> None:
        super().__init__(bin_ids, capacity_pages)
        self._weights = weights or PriorityWeights()
        self._rtt_ms = dict(rtt_ms) if rtt_ms is not None else None
        self._labels: dict[str, tuple[int, SizeClass | None]] = {}  # bin -> (its revision, its label)

    def label(self, bin_id: str) -> SizeClass | None:
        """Gives the class of the largest unit on `bin_id` (multi-items count as T), None for an empty bin."""
        revision = self._state.bin_revision[bin_id]
        cached = self._labels.get(bin_id)
        if cached is not None and cached[0] == revision:
            return cached[1]
        units = self._state.units_on[bin_id]
        label = max((self._unit_class(unit) for unit in units), key=class_rank) if units else None
        self._labels[bin_id] = (revision, label)
        return label

    def newest(self, label: SizeClass | str) -> str | None:
        """Gives the most recently activated bin labelled `label`, None if there is none."""
        return self._newest(SizeClass(label), _NONE)

    def invariant_violations(self) -> list[str]:
        """Gives what breaks capacity, the bookkeeping, or Theorem 1 outside the newest bin of each label."""
        state, capacity = self._state, self._state.capacity_pages
        problems = state.structural_violations()
        for unit, members in state.members.items():
            if unit in state.groups:
                if not fits_multi_item(state.unit_pages[unit], capacity):
                    problems.append(f"multi-item {unit} holds {state.unit_pages[unit]} pages, over C/4")
                if any(size_class(state.pages[s], capacity) is not TINY for s in members):
                    problems.append(f"multi-item {unit} holds a session larger than C/8")
            elif len(members) != 1 or size_class(state.unit_pages[unit], capacity) is TINY:
                problems.append(f"unit {unit}: a tiny session outside a multi-item, or a unit of several sessions")
        labels = {bin_id: self.label(bin_id) for bin_id in state.active_bins()}
        exempt = {self._newest(label, _NONE) for label in (L, M, S, T)}
        t_bins_exist = T in labels.values()
        s_or_m_on_s_or_m_bins = [
            state.unit_pages[unit]
            for bin_id, label in labels.items()
            if label in (S, M)
            for unit in state.units_on[bin_id]
            if self._unit_class(unit) in (S, M)
        ]
        for bin_id, label in labels.items():
            incomplete = [g for g in self._groups_on(bin_id) if is_incomplete_multi_item(state.unit_pages[g], capacity)]
            if len(incomplete) > 1:
                problems.append(f"bin {bin_id}: {len(incomplete)} multi-items of at most C/8")
            if bin_id in exempt:
                continue
            full = at_least_three_quarters(state.loads[bin_id], capacity)
            if label is M and (self._count(bin_id, M) != 2 or self._count(bin_id, S) > 0):
                problems.append(f"property 1: M-bin {bin_id} holds {self._classes_on(bin_id)}")
            if label is S and self._count(bin_id, S) != 3:
                problems.append(f"property 2: S-bin {bin_id} holds {self._classes_on(bin_id)}")
            if label is T and not full:
                problems.append(f"property 3: T-bin {bin_id} is below 75% ({state.loads[bin_id]}/{capacity})")
            if label is L and not self._has_s_or_m(bin_id):
                l_pages = self._l_pages(bin_id)
                if any(l_pages + pages < capacity for pages in s_or_m_on_s_or_m_bins):
                    problems.append(f"property 4: L-bin {bin_id} has no S/M though one on an S/M-bin fits")
            if t_bins_exist and label in (L, M) and not full:
                problems.append(f"property 5: {label}-bin {bin_id} below 75% while T-bins exist")
        return problems

    def _restored(self) -> None:
        self._labels.clear()

    def _interchangeable(self, unit_a: str, unit_b: str) -> bool:
        """Units of one class may trade bins: every bin keeps its label and its count of each class (Theorem 1)."""
        return self._unit_class(unit_a) is self._unit_class(unit_b)

    # ---- the three operations

    def _allocate(self, item: Item) -> None:
        if size_class(item.pages, self.capacity_pages) is TINY:
            self._place_tiny(item.item_id, item.pages)
        else:
            self._state.add_unit(item.item_id, {item.item_id: item.pages})
            self._place(item.item_id, _NONE)

    def _depart(self, session_id: str) -> None:
        state = self._state
        unit = state.unit_of[session_id]
        bin_id = state.bin_of_unit[unit]
        label_before = self.label(bin_id)
        lost, whole = self._unit_class(unit), len(state.members[unit]) == 1
        state.remove_session(session_id)
        if not whole:
            self._merge_small_groups(bin_id)
        self._vacate(bin_id, lost, label_before, _NONE, whole_unit_left=whole)

    def _update(self, session_id: str, new_pages: int) -> None:
        state, capacity = self._state, self.capacity_pages
        unit = state.unit_of[session_id]
        bin_id = state.bin_of_unit[unit]
        label_before = self.label(bin_id)
        old_class = self._unit_class(unit)
        new_class = size_class(new_pages, capacity)
        state.set_pages(session_id, new_pages)
        if unit in state.groups:
            if new_class is TINY:
                if not fits_multi_item(state.unit_pages[unit], capacity):
                    state.transfer(session_id, state.new_group())
                    self._merge_small_groups(bin_id)
                self._resolve_overload(bin_id, state.unit_of[session_id])
                return
            state.transfer(session_id, session_id)  # it leaves its multi-item and becomes a unit of its own
            self._merge_small_groups(bin_id)
            unit = session_id
            if new_class is T:
                self._resolve_overload(bin_id, unit)
                return
        elif new_class is old_class or (new_class is L and old_class is M and label_before is M):
            self._resolve_overload(bin_id, unit)  # M -> L on an M-bin stays; its neighbours make room
            return
        state.take(unit)
        placed = self._place(unit, _NONE, prefer=bin_id)
        if placed != bin_id:
            self._vacate(bin_id, old_class, label_before, _NONE, whole_unit_left=True)

    # ---- Allocate

    def _place_tiny(self, session_id: str, pages: int) -> None:
        state = self._state
        bin_id = self._t_bin(pages, _NONE)
        groups = [
            g for g in self._groups_on(bin_id) if fits_multi_item(state.unit_pages[g] + pages, self.capacity_pages)
        ]
        if groups:
            state.join(min(groups, key=lambda g: (state.unit_pages[g], g)), session_id, pages)
        else:
            group = state.new_group()
            state.add_unit(group, {session_id: pages})
            state.put(group, bin_id)

    def _place(self, unit: str, exclude: frozenset[str], prefer: str | None = None) -> str:
        """Allocates `unit` (already off every bin) by its class; gives the bin it lands on."""
        state, capacity = self._state, self.capacity_pages
        kind, pages = self._unit_class(unit), state.unit_pages[unit]
        if kind is T:
            bin_id = self._t_bin(pages, exclude, prefer)
            state.put(unit, bin_id)
            self._merge_small_groups(bin_id)
            return bin_id
        if kind is L:
            bin_id = self._fresh_bin(prefer)
            state.put(unit, bin_id)
            self._fill_l_bin(bin_id, exclude)
            return bin_id
        beside_l = [
            b
            for b in state.activation
            if b not in exclude
            and self.label(b) is L
            and not self._has_s_or_m(b)
            and self._l_pages(b) + pages < capacity
        ]
        if beside_l:
            bin_id = prefer if prefer in beside_l else self._by_priority(beside_l)
            state.put(unit, bin_id)
            self._make_room(bin_id, unit, exclude)
            return bin_id
        newest = self._newest(kind, exclude)
        if newest is not None and self._count(newest, kind) < _PER_BIN[kind]:
            state.put(unit, newest)
            self._make_room(newest, unit, exclude)
            self._pull_t(newest, exclude, one_anyway=False)
            return newest
        bin_id = self._fresh_bin(prefer)
        state.put(unit, bin_id)
        return bin_id

    def _t_bin(self, pages: int, exclude: frozenset[str], prefer: str | None = None) -> str:
        """Gives the bin a T of `pages` pages goes to: an L-bin (or an M-bin below 75%), else the newest T-bin."""
        state, capacity = self._state, self.capacity_pages
        fitting = [b for b in state.activation if b not in exclude and state.loads[b] + pages <= capacity]
        takers = [b for b in fitting if self._takes_t(b)]
        if takers:
            return prefer if prefer in takers else self._by_priority(takers)
        newest = self._newest(T, exclude)
        if newest is not None and newest in fitting:
            return newest
        return self._fresh_bin(prefer)

    def _takes_t(self, bin_id: str) -> bool:
        label = self.label(bin_id)
        if label is L:
            return True
        full = at_least_three_quarters(self._state.loads[bin_id], self.capacity_pages)
        return label is M and self._count(bin_id, M) == 2 and not full

    def _fresh_bin(self, prefer: str | None) -> str:
        state = self._state
        if prefer is not None and state.is_active(prefer) and not state.units_on[prefer]:
            state.stamp(prefer)  # emptied and reused within this operation: it counts as newly activated
            return prefer
        return state.activate()

    def _make_room(self, bin_id: str, keep: str, exclude: frozenset[str]) -> None:
        """Re-allocates T's of `bin_id` (largest first) until it is within capacity."""
        state = self._state
        while state.loads[bin_id] > self.capacity_pages:
            ts = [u for u in state.units_on[bin_id] if u != keep and self._unit_class(u) is T]
            if not ts:
                raise AssertionError(f"bin {bin_id} is over capacity with no T to move")
            victim = min(ts, key=lambda u: (-state.unit_pages[u], u))
            state.take(victim)
            self._place(victim, exclude | {bin_id})

    def _fill_l_bin(self, bin_id: str, exclude: frozenset[str]) -> None:
        """Pulls an S/M beside the L of `bin_id` if one fits (property 4), then T's while it is below 75% (5)."""
        state, capacity = self._state, self.capacity_pages
        if not self._has_s_or_m(bin_id):
            l_pages = self._l_pages(bin_id)
            fitting: dict[str, list[str]] = {}
            for source in state.activation:
                if source != bin_id and source not in exclude and self.label(source) in (S, M):
                    units = [
                        u
                        for u in state.units_on[source]
                        if self._unit_class(u) in (S, M) and l_pages + state.unit_pages[u] < capacity
                    ]
                    if units:
                        fitting[source] = units
            if fitting:
                max_sessions = self._max_sessions()
                source = min(fitting, key=lambda b: (-self._link_priority(bin_id, b, max_sessions), b))
                unit = min(fitting[source], key=lambda u: (-state.unit_pages[u], u))
                source_label = self.label(source)
                state.take(unit)
                state.put(unit, bin_id)
                self._make_room(bin_id, unit, exclude)
                self._refill(source, source_label, exclude)
        self._pull_t(bin_id, exclude, one_anyway=False)

    # ---- Depart

    def _vacate(
        self,
        bin_id: str,
        lost: SizeClass,
        label_before: SizeClass | None,
        exclude: frozenset[str],
        *,
        whole_unit_left: bool,
    ) -> None:
        """Repairs `bin_id` after a unit of class `lost` left it (or a multi-item on it shrank)."""
        state = self._state
        state.release_if_empty(bin_id)
        if not state.is_active(bin_id):
            return
        label = self.label(bin_id)
        if label is not label_before:
            self._empty_bin(bin_id, exclude)
        elif lost in (S, M):
            if label is L:
                self._fill_l_bin(bin_id, exclude)
            else:
                self._refill(bin_id, label, exclude)
        else:
            self._pull_t(bin_id, exclude, one_anyway=whole_unit_left)

    def _refill(self, bin_id: str, label_before: SizeClass | None, exclude: frozenset[str]) -> None:
        """Refills an S- or M-bin that lost one of its units from the newest bin of its label."""
        state = self._state
        state.release_if_empty(bin_id)
        if not state.is_active(bin_id):
            return
        if self.label(bin_id) is not label_before or label_before not in (S, M):
            self._empty_bin(bin_id, exclude)
            return
        newest = self._newest(label_before, exclude)
        if newest is None or newest == bin_id:
            return
        units = [u for u in state.units_on[newest] if self._unit_class(u) is label_before]
        unit = min(units, key=lambda u: (-state.unit_pages[u], u))
        state.take(unit)
        state.put(unit, bin_id)
        self._make_room(bin_id, unit, exclude)
        state.release_if_empty(newest)
        if state.is_active(newest) and self.label(newest) is not label_before:
            self._empty_bin(newest, exclude)  # the newest M-bin gave its last M and holds only T's
        self._pull_t(bin_id, exclude, one_anyway=False)

    def _empty_bin(self, bin_id: str, exclude: frozenset[str]) -> None:
        """Re-allocates every unit on `bin_id`, largest class first, and releases it."""
        state = self._state
        exclude = exclude | {bin_id}
        order = sorted(
            state.units_on[bin_id],
            key=lambda u: (-class_rank(self._unit_class(u)), -state.unit_pages[u], u),
        )
        for unit in order:
            if state.bin_of_unit.get(unit) == bin_id:
                state.take(unit)
                self._place(unit, exclude)
        state.release_if_empty(bin_id)

    def _pull_t(self, bin_id: str, exclude: frozenset[str], *, one_anyway: bool) -> None:
        """Pulls T's from the newest T-bin into `bin_id` while it is below 75% (and one anyway if `one_anyway`)."""
        state, capacity = self._state, self.capacity_pages
        label = self.label(bin_id)
        if label in (None, S) or (label is M and self._count(bin_id, M) < 2):
            return
        pulled = 0
        while True:
            below = not at_least_three_quarters(state.loads[bin_id], capacity)
            if not below and (pulled > 0 or not one_anyway or label is M):
                return
            newest = self._newest(T, exclude)
            if newest is None or newest == bin_id:
                return
            fitting = [u for u in state.units_on[newest] if state.loads[bin_id] + state.unit_pages[u] <= capacity]
            if not fitting:
                return
            unit = min(fitting, key=lambda u: (-state.unit_pages[u], u))
            state.take(unit)
            state.put(unit, bin_id)
            self._merge_small_groups(bin_id)
            state.release_if_empty(newest)
            pulled += 1

    # ---- Update

    def _resolve_overload(self, bin_id: str, grown: str) -> None:
        """Brings `bin_id` back within capacity after `grown` grew: smaller classes leave, else `grown` moves."""
        state = self._state
        exclude = frozenset({bin_id})
        while state.loads[bin_id] > self.capacity_pages:
            grown_rank = class_rank(self._unit_class(grown))
            victims = [
                u
                for u in state.units_on[bin_id]
                if u != grown and (class_rank(self._unit_class(u)) < grown_rank or self._unit_class(u) is T)
            ]
            if not victims:
                label, lost = self.label(bin_id), self._unit_class(grown)
                state.take(grown)
                self._place(grown, exclude)
                self._vacate(bin_id, lost, label, _NONE, whole_unit_left=True)
                return
            victim = min(victims, key=lambda u: (class_rank(self._unit_class(u)), -state.unit_pages[u], u))
            state.take(victim)
            self._place(victim, exclude)
        if self.label(bin_id) is L:
            self._fill_l_bin(bin_id, _NONE)

    # ---- helpers

    def _unit_class(self, unit: str) -> SizeClass:
        if unit in self._state.groups:
            return T
        return size_class(self._state.unit_pages[unit], self.capacity_pages)

    def _count(self, bin_id: str, kind: SizeClass) -> int:
        return sum(1 for u in self._state.units_on[bin_id] if self._unit_class(u) is kind)

    def _classes_on(self, bin_id: str) -> str:
        return "".join(sorted((str(self._unit_class(u)) for u in self._state.units_on[bin_id]), reverse=True))

    def _has_s_or_m(self, bin_id: str) -> bool:
        return any(self._unit_class(u) in (S, M) for u in self._state.units_on[bin_id])

    def _l_pages(self, bin_id: str) -> int:
        return max(self._state.unit_pages[u] for u in self._state.units_on[bin_id] if self._unit_class(u) is L)

    def _groups_on(self, bin_id: str) -> list[str]:
        return [u for u in self._state.units_on[bin_id] if u in self._state.groups]

    def _merge_small_groups(self, bin_id: str) -> None:
        """Merges multi-items of at most C/8 on `bin_id` in place, so that at most one is left (no move)."""
        state = self._state
        while True:
            small = [
                g for g in self._groups_on(bin_id) if is_incomplete_multi_item(state.unit_pages[g], self.capacity_pages)
            ]
            if len(small) < 2:
                return
            for session_id in state.members[small[1]]:
                state.transfer(session_id, small[0])

    def _newest(self, label: SizeClass, exclude: frozenset[str]) -> str | None:
        state = self._state
        labelled = [b for b in state.activation if b not in exclude and self.label(b) is label]
        return max(labelled, key=state.activation.__getitem__, default=None)

    def _max_sessions(self) -> int:
        if self._weights.max_sessions is not None:
            return self._weights.max_sessions
        return max((self._state.session_count(b) for b in self._state.activation), default=1)

    def _priority(self, bin_id: str, max_sessions: int) -> float:
        state = self._state
        return bin_priority(
            state.free(bin_id), self.capacity_pages, state.session_count(bin_id), max_sessions, self._weights
        )

    def _link_priority(self, src: str, dst: str, max_sessions: int) -> float:
        rtt = rtt_between(self._rtt_ms, src, dst)
        return self._priority(dst, max_sessions) - self._weights.rtt_weight_per_ms * rtt

    def _by_priority(self, bins: list[str]) -> str:
        max_sessions = self._max_sessions()
        return min(bins, key=lambda b: (-self._priority(b, max_sessions), b))
