"""What every packer takes and gives: sessions as items, the moves an operation causes, errors, the `Packer` interface.

A bin is a server (a GPU in MELL's words) with a KV capacity of C pages; an item is a session with a page count that
only grows while it runs. Every operation answers with the moves of running sessions it causes; where an arriving
session lands is `bin_of(session_id)` afterwards (a placement, not a migration).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Item:
    """A session to pack: its id and the KV pages it holds now."""

    item_id: str
    pages: int


@dataclass(frozen=True)
class Move:
    """Session `session_id` (`pages` pages) migrates from bin `src` to bin `dst`.

    `unit_id` is what moved as one: the session itself, or the MELL multi-item it belongs to (its sessions move
    together and count as one migration, as in Theorem 3).
    """

    session_id: str
    src: str
    dst: str
    pages: int
    unit_id: str


def count_migrations(moves: Iterable[Move]) -> int:
    """Gives the migrations in `moves` as Theorem 3 counts them: a multi-item's sessions moving together count once."""
    return len({(move.unit_id, move.src, move.dst) for move in moves})


class PackingError(Exception):
    """A packing operation cannot be carried out; the packer's state is as it was before the call."""


class NoFreeBin(PackingError):
    """Every bin is active and the operation needs one more: give the packer more bins (or standby servers)."""


class ItemTooLarge(PackingError, ValueError):
    """A session holds more pages than one bin: no placement exists (MELL assumes every request fits one GPU)."""


class UnknownItem(PackingError, LookupError):
    """The session id is not packed here (never allocated, or already departed)."""


class DuplicateItem(PackingError, ValueError):
    """The session id is already packed here: allocate each session once."""


class PagesShrank(PackingError, ValueError):
    """A session's pages only grow while it runs; an update gave fewer pages than it holds."""


class InvariantViolation(AssertionError):
    """The packing breaks a property its policy promises (capacity, bookkeeping, or MELL's Theorem 1)."""


class Packer(Protocol):
    """The interface a simulator and a live orchestrator drive; MELL and the baselines all implement it."""

    name: str

    @property
    def capacity_pages(self) -> int:
        """Gives C, the KV pages of every bin."""

    @property
    def bins(self) -> tuple[str, ...]:
        """Gives every bin id, active or not, in the order the packer was given them."""

    def active_bins(self) -> tuple[str, ...]:
        """Gives the bins that hold sessions, oldest activation first."""

    def load(self, bin_id: str) -> int:
        """Gives the pages the sessions on `bin_id` hold."""

    def bin_of(self, session_id: str) -> str:
        """Gives the bin `session_id` runs on."""

    def assignment(self) -> dict[str, str]:
        """Gives every session's bin."""

    def pages_of(self, session_id: str) -> int:
        """Gives the pages `session_id` holds."""

    def unit_of(self, session_id: str) -> str:
        """Gives the unit `session_id` moves with (the `unit_id` of its moves)."""

    def exchange(self, session_a: str, session_b: str) -> bool:
        """Swaps the bins of the two sessions' units if the packing allows it; gives whether it did."""

    def allocate(self, item: Item) -> list[Move]:
        """Places an arriving session; gives the moves of running sessions this causes."""

    def depart(self, item_id: str) -> list[Move]:
        """Removes a finished session; gives the moves this causes."""

    def update(self, item_id: str, new_pages: int) -> list[Move]:
        """Records that a session grew to `new_pages`; gives the moves this causes."""

    def check_invariants(self) -> None:
        """Raises InvariantViolation if the packing breaks what this packer promises."""
