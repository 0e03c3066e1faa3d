"""Bins of one page capacity, the units packed on them, their activation order, and the moves one operation makes.

A unit is what moves as one: a session, or a MELL multi-item (tiny sessions kept together). Every change of place
goes through `take` (a unit leaves its bin) and `put` (it lands on a bin); a unit put on another bin than the one it
was taken from moves each of its sessions, and the operation's log records it. At the end of an operation the log
gives each session's net move (first source to final bin), so a session moved twice within one operation, or moved
away and back, costs one migration or none.

A bin is active from the moment it first gets a unit until it is released empty; `activate` stamps it with the next
activation number, so "the newest bin" of any kind is well defined.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

from orchestrator.packing.records import (
    DuplicateItem,
    InvariantViolation,
    Item,
    ItemTooLarge,
    Move,
    NoFreeBin,
    PagesShrank,
    UnknownItem,
)


class MoveLog:
    """The net moves of the sessions that existed when the current operation began."""

    def __init__(self) -> None:
        self.origin: dict[str, str] = {}  # session -> its bin before its first move in this operation
        self.unit_at_move: dict[str, str] = {}
        self.new_sessions: set[str] = set()

    def record(self, session_id: str, src: str, unit_id: str) -> None:
        if session_id not in self.new_sessions and session_id not in self.origin:
            self.origin[session_id] = src
            self.unit_at_move[session_id] = unit_id


class BinState:
    """Sessions, units, bins and loads of one packer; the only place where they change."""

    def __init__(self, bin_ids: Sequence[str], capacity_pages: int) -> None:
        if capacity_pages < 1:
            raise ValueError(f"bins need a capacity of at least 1 page, got {capacity_pages}")
        if not bin_ids or len(set(bin_ids)) != len(bin_ids):
            raise ValueError("give at least one bin, each id once")
        self.capacity_pages = capacity_pages
        self.bin_ids = tuple(bin_ids)
        self.pages: dict[str, int] = {}  # session -> pages
        self.unit_of: dict[str, str] = {}  # session -> unit
        self.members: dict[str, tuple[str, ...]] = {}  # unit -> sessions
        self.unit_pages: dict[str, int] = {}
        self.bin_of_unit: dict[str, str] = {}
        self.units_on: dict[str, tuple[str, ...]] = {bin_id: () for bin_id in bin_ids}
        self.loads: dict[str, int] = dict.fromkeys(bin_ids, 0)
        self.activation: dict[str, int] = {}  # active bin -> activation number
        self.next_activation = 0
        self.next_group = 0
        self.groups: set[str] = set()  # units that are multi-items
        self.in_transit: dict[str, str] = {}  # unit taken off a bin and not yet put -> that bin
        self.revision = 0
        self.bin_revision: dict[str, int] = dict.fromkeys(bin_ids, 0)  # changes whenever a bin's content does
        self.log = MoveLog()

    def copy(self) -> BinState:
        """Gives an independent copy (values are immutable, so shallow copies of the tables suffice)."""
        twin = copy.copy(self)
        tables = ("pages", "unit_of", "members", "unit_pages", "bin_of_unit", "units_on", "loads", "activation")
        for name in (*tables, "bin_revision"):
            setattr(twin, name, dict(getattr(self, name)))
        twin.groups = set(self.groups)
        twin.in_transit = dict(self.in_transit)
        twin.log = MoveLog()  # a copy is taken between operations, when the log no longer matters
        return twin

    # ---- queries

    def active_bins(self) -> tuple[str, ...]:
        """Gives the active bins, oldest activation first."""
        return tuple(sorted(self.activation, key=self.activation.__getitem__))

    def is_active(self, bin_id: str) -> bool:
        return bin_id in self.activation

    def free(self, bin_id: str) -> int:
        return self.capacity_pages - self.loads[bin_id]

    def sessions_on(self, bin_id: str) -> tuple[str, ...]:
        return tuple(session for unit in self.units_on[bin_id] for session in self.members[unit])

    def session_count(self, bin_id: str) -> int:
        return sum(len(self.members[unit]) for unit in self.units_on[bin_id])

    def bin_of(self, session_id: str) -> str:
        if session_id not in self.unit_of:
            raise UnknownItem(f"session {session_id!r} is not packed here")
        return self.bin_of_unit[self.unit_of[session_id]]

    def assignment(self) -> dict[str, str]:
        return {session: self.bin_of_unit[unit] for session, unit in self.unit_of.items()}

    # ---- sessions and units

    def check_new(self, session_id: str, pages: int) -> None:
        """Raises if `session_id` is packed already or `pages` cannot fit a bin."""
        if session_id in self.pages or session_id in self.members:
            raise DuplicateItem(f"session {session_id!r} is already packed (or names a multi-item)")
        self.check_fits(session_id, pages)

    def check_fits(self, session_id: str, pages: int) -> None:
        if pages < 0 or pages > self.capacity_pages:
            raise ItemTooLarge(f"session {session_id!r} needs {pages} pages; a bin holds {self.capacity_pages}")

    def new_group(self) -> str:
        """Gives the id of a new, empty multi-item (an id no session or unit uses)."""
        while True:
            self.next_group += 1
            group_id = f"multi:{self.next_group}"
            if group_id not in self.members and group_id not in self.pages:
                self.groups.add(group_id)
                return group_id

    def add_unit(self, unit_id: str, sessions: dict[str, int]) -> None:
        """Registers arriving sessions as one unit, not yet on a bin (`put` places it, with no move)."""
        for session_id, pages in sessions.items():
            self.pages[session_id] = pages
            self.unit_of[session_id] = unit_id
            self.log.new_sessions.add(session_id)
        self.members[unit_id] = tuple(sessions)
        self.unit_pages[unit_id] = sum(sessions.values())

    def join(self, unit_id: str, session_id: str, pages: int) -> None:
        """Adds an arriving session to a unit already on a bin."""
        self.pages[session_id] = pages
        self.unit_of[session_id] = unit_id
        self.log.new_sessions.add(session_id)
        self.members[unit_id] += (session_id,)
        self.unit_pages[unit_id] += pages
        self.loads[self.bin_of_unit[unit_id]] += pages
        self.touch(self.bin_of_unit[unit_id])

    def set_pages(self, session_id: str, pages: int) -> None:
        unit_id = self.unit_of[session_id]
        delta = pages - self.pages[session_id]
        self.pages[session_id] = pages
        self.unit_pages[unit_id] += delta
        if unit_id in self.bin_of_unit:
            self.loads[self.bin_of_unit[unit_id]] += delta
            self.touch(self.bin_of_unit[unit_id])

    def remove_session(self, session_id: str) -> None:
        """Takes a departing session out of its unit (and the unit off its bin once empty); keeps the bin active."""
        unit_id = self.unit_of.pop(session_id)
        pages = self.pages.pop(session_id)
        self.members[unit_id] = tuple(s for s in self.members[unit_id] if s != session_id)
        self.unit_pages[unit_id] -= pages
        self.loads[self.bin_of_unit[unit_id]] -= pages
        self.touch(self.bin_of_unit[unit_id])
        if not self.members[unit_id]:
            self.take(unit_id)
            self.in_transit.pop(unit_id)
            self._forget_unit(unit_id)

    def transfer(self, session_id: str, to_unit: str) -> None:
        """Moves a session into another unit on the same bin (or a new unit not yet placed, put there next)."""
        from_unit = self.unit_of[session_id]
        pages = self.pages[session_id]
        self.members[from_unit] = tuple(s for s in self.members[from_unit] if s != session_id)
        self.unit_pages[from_unit] -= pages
        self.members.setdefault(to_unit, ())
        self.unit_pages.setdefault(to_unit, 0)
        self.members[to_unit] += (session_id,)
        self.unit_pages[to_unit] += pages
        self.unit_of[session_id] = to_unit
        bin_id = self.bin_of_unit[from_unit]
        self.touch(bin_id)
        if to_unit not in self.bin_of_unit:
            self.bin_of_unit[to_unit] = bin_id
            self.units_on[bin_id] += (to_unit,)
        elif self.bin_of_unit[to_unit] != bin_id:
            raise ValueError("transfer keeps a session on its bin")
        if not self.members[from_unit]:
            self.units_on[bin_id] = tuple(u for u in self.units_on[bin_id] if u != from_unit)
            del self.bin_of_unit[from_unit]
            self._forget_unit(from_unit)

    def _forget_unit(self, unit_id: str) -> None:
        del self.members[unit_id]
        del self.unit_pages[unit_id]
        self.groups.discard(unit_id)

    # ---- places

    def take(self, unit_id: str) -> str:
        """Takes a unit off its bin (the bin stays active, even if empty, until `release_if_empty`)."""
        bin_id = self.bin_of_unit.pop(unit_id)
        self.units_on[bin_id] = tuple(u for u in self.units_on[bin_id] if u != unit_id)
        self.loads[bin_id] -= self.unit_pages[unit_id]
        self.touch(bin_id)
        self.in_transit[unit_id] = bin_id
        return bin_id

    def put(self, unit_id: str, bin_id: str) -> None:
        """Puts a unit on an active bin; if it was taken from another bin, each of its sessions moved."""
        if bin_id not in self.activation:
            raise ValueError(f"bin {bin_id!r} is not active")
        self.bin_of_unit[unit_id] = bin_id
        self.units_on[bin_id] += (unit_id,)
        self.loads[bin_id] += self.unit_pages[unit_id]
        self.touch(bin_id)
        src = self.in_transit.pop(unit_id, None)
        if src is not None and src != bin_id:
            for session_id in self.members[unit_id]:
                self.log.record(session_id, src, unit_id)

    def touch(self, bin_id: str) -> None:
        """Marks that the content of `bin_id` changed (what a packer derived from it must be derived again)."""
        self.revision += 1
        self.bin_revision[bin_id] = self.revision

    def activate(self) -> str:
        """Activates the first inactive bin in the given order and gives its id."""
        for bin_id in self.bin_ids:
            if bin_id not in self.activation:
                self.stamp(bin_id)
                return bin_id
        raise NoFreeBin(f"all {len(self.bin_ids)} bins are active")

    def stamp(self, bin_id: str) -> None:
        """Gives `bin_id` the next activation number: it becomes the newest bin."""
        self.activation[bin_id] = self.next_activation
        self.next_activation += 1

    def release_if_empty(self, bin_id: str) -> None:
        if bin_id in self.activation and not self.units_on[bin_id]:
            del self.activation[bin_id]

    # ---- operations

    def begin_operation(self) -> None:
        self.log = MoveLog()

    def finish_operation(self) -> list[Move]:
        """Gives the operation's net moves, in the order the sessions first moved; releases emptied bins."""
        if self.in_transit:
            raise AssertionError(f"units left off every bin: {sorted(self.in_transit)}")
        for bin_id in list(self.activation):
            self.release_if_empty(bin_id)
        moves = []
        for session_id, src in self.log.origin.items():
            if session_id in self.unit_of and self.bin_of(session_id) != src:
                dst = self.bin_of(session_id)
                moves.append(Move(session_id, src, dst, self.pages[session_id], self.log.unit_at_move[session_id]))
        return moves

    def structural_violations(self) -> list[str]:
        """Gives what breaks capacity or the bookkeeping (empty when the state is sound)."""
        problems = []
        capacity = self.capacity_pages
        for bin_id in self.bin_ids:
            units = self.units_on[bin_id]
            load = sum(self.unit_pages[unit] for unit in units)
            if load != self.loads[bin_id]:
                problems.append(f"bin {bin_id}: load {self.loads[bin_id]} but its units hold {load}")
            if load > capacity:
                problems.append(f"bin {bin_id}: {load} pages over capacity {capacity}")
            if bool(units) != (bin_id in self.activation):
                problems.append(f"bin {bin_id}: active={bin_id in self.activation} with {len(units)} units")
            for unit in units:
                if self.bin_of_unit.get(unit) != bin_id:
                    problems.append(f"unit {unit} listed on {bin_id} but placed on {self.bin_of_unit.get(unit)}")
        for unit, members in self.members.items():
            if not members or sum(self.pages[s] for s in members) != self.unit_pages[unit]:
                problems.append(f"unit {unit}: members {members} do not add up to {self.unit_pages[unit]} pages")
            if any(self.unit_of[s] != unit for s in members):
                problems.append(f"unit {unit}: a member is filed under another unit")
        if set(self.unit_of) != set(self.pages):
            problems.append("sessions and units disagree")
        return problems


class BinPacker:
    """What every packer shares: its `BinState`, the read side of the `Packer` interface, and all-or-nothing calls.

    An operation that raises NoFreeBin leaves the packer as it was before the call.
    """

    name = "packer"

    def __init__(self, bin_ids: Sequence[str], capacity_pages: int) -> None:
        self._state = BinState(bin_ids, capacity_pages)

    @property
    def capacity_pages(self) -> int:
        return self._state.capacity_pages

    @property
    def bins(self) -> tuple[str, ...]:
        return self._state.bin_ids

    def active_bins(self) -> tuple[str, ...]:
        return self._state.active_bins()

    def load(self, bin_id: str) -> int:
        return self._state.loads[bin_id]

    def bin_of(self, session_id: str) -> str:
        return self._state.bin_of(session_id)

    def assignment(self) -> dict[str, str]:
        return self._state.assignment()

    def sessions_on(self, bin_id: str) -> tuple[str, ...]:
        """Gives the sessions on `bin_id`."""
        return self._state.sessions_on(bin_id)

    def pages_of(self, session_id: str) -> int:
        """Gives the pages `session_id` holds."""
        self._known(session_id)
        return self._state.pages[session_id]

    def unit_of(self, session_id: str) -> str:
        """Gives the unit `session_id` moves with: itself, or its multi-item."""
        self._known(session_id)
        return self._state.unit_of[session_id]

    def exchange(self, session_a: str, session_b: str) -> bool:
        """Swaps the bins of the units holding two sessions on different bins, if each still fits where the other
        was, this packer deems them interchangeable and the packing breaks nothing it did not break before; gives
        whether it swapped. Used between operations (batching), never inside one."""
        state = self._state
        unit_a, unit_b = self.unit_of(session_a), self.unit_of(session_b)
        bin_a, bin_b = state.bin_of_unit[unit_a], state.bin_of_unit[unit_b]
        pages_a, pages_b = state.unit_pages[unit_a], state.unit_pages[unit_b]
        if bin_a == bin_b or not self._interchangeable(unit_a, unit_b):
            return False
        if max(state.loads[bin_a] - pages_a + pages_b, state.loads[bin_b] - pages_b + pages_a) > state.capacity_pages:
            return False
        before = set(self.invariant_violations())
        saved = state.copy()
        state.take(unit_a)
        state.take(unit_b)
        state.put(unit_a, bin_b)
        state.put(unit_b, bin_a)
        if set(self.invariant_violations()) <= before:
            return True
        self._state = saved
        self._restored()
        return False

    def allocate(self, item: Item) -> list[Move]:
        """Places a new session; gives the moves of running sessions it causes."""
        self._state.check_new(item.item_id, item.pages)
        return self._operation(lambda: self._allocate(item))

    def depart(self, item_id: str) -> list[Move]:
        """Removes a session that ended; gives the moves it causes."""
        self._known(item_id)
        return self._operation(lambda: self._depart(item_id))

    def update(self, item_id: str, new_pages: int) -> list[Move]:
        """Grows a session to `new_pages`; gives the moves it causes."""
        if not self._checked_growth(item_id, new_pages):
            return []
        return self._operation(lambda: self._update(item_id, new_pages))

    def _allocate(self, item: Item) -> None:
        raise NotImplementedError

    def _depart(self, item_id: str) -> None:
        raise NotImplementedError

    def _update(self, item_id: str, new_pages: int) -> None:
        raise NotImplementedError

    def _interchangeable(self, unit_a: str, unit_b: str) -> bool:
        """Tells whether two units may trade bins: for a packer with no structure beyond capacity, any two."""
        return True

    def invariant_violations(self) -> list[str]:
        """Gives what breaks capacity or the bookkeeping (subclasses add their policy's properties)."""
        return self._state.structural_violations()

    def check_invariants(self) -> None:
        problems = self.invariant_violations()
        if problems:
            raise InvariantViolation("; ".join(problems))

    def _known(self, session_id: str) -> None:
        if session_id not in self._state.pages:
            raise UnknownItem(f"session {session_id!r} is not packed here")

    def _checked_growth(self, session_id: str, new_pages: int) -> bool:
        """Validates an update; tells whether the session really grows."""
        self._known(session_id)
        self._state.check_fits(session_id, new_pages)
        old_pages = self._state.pages[session_id]
        if new_pages < old_pages:
            raise PagesShrank(f"session {session_id!r} holds {old_pages} pages; an update cannot give {new_pages}")
        return new_pages > old_pages

    def _operation(self, body: Callable[[], None]) -> list[Move]:
        saved = self._state.copy()
        self._state.begin_operation()
        try:
            body()
            return self._state.finish_operation()
        except NoFreeBin:
            self._state = saved
            self._restored()
            raise

    def _restored(self) -> None:
        """Runs after a failed operation put the saved state back (drop whatever was derived from the other one)."""
