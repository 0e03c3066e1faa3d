"""The slot pool: one memory budget split into fixed-size pages, each free or held by exactly one owner."""

from __future__ import annotations

import heapq
import math
import re
import threading
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import psutil
import torch

from swarm.errors import OutOfPages

DEFAULT_PAGE_BYTES = 1 << 20
CUDA_BUDGET_FRACTION = 0.9
CPU_BUDGET_FRACTION = 0.5

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Gives the number of bytes in a size such as "2GB", "512MB", "1.5GiB", "64KiB" or "4096"."""
    match = _SIZE_PATTERN.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot parse size {text!r}: expected a number with an optional unit "
            f"(B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024), e.g. '2GB' or '1.5GiB'"
        )
    try:
        # Decimal keeps "1.5GiB" exact where a float product could land one byte off.
        size = Decimal(match.group(1)) * _SIZE_UNITS[unit]
    except InvalidOperation as error:
        raise ValueError(f"cannot parse size {text!r}: {error}") from error
    if size != size.to_integral_value():
        raise ValueError(f"size {text!r} is not a whole number of bytes ({size})")
    return int(size)


def default_budget_bytes(device: torch.device) -> int:
    """Gives the pool budget when none is configured: 90% of free CUDA memory, or half of available host RAM."""
    if device.type == "cuda":
        free_bytes, _total_bytes = torch.cuda.mem_get_info(device)
        return int(free_bytes * CUDA_BUDGET_FRACTION)
    if device.type == "cpu":
        return int(psutil.virtual_memory().available * CPU_BUDGET_FRACTION)
    raise ValueError(f"no default memory budget for device type {device.type!r}; pass an explicit size")


@dataclass(frozen=True)
class ParamsOwner:
    """The parameters of one hosted block."""

    block: int


@dataclass(frozen=True)
class KVOwner:
    """One session's KV cache for one block."""

    session_id: str
    block: int


Owner = ParamsOwner | KVOwner


@dataclass(frozen=True)
class PoolStats:
    """A consistent snapshot of how the pool's pages are split."""

    pages_total: int
    pages_params: int
    pages_kv: int
    pages_free: int
    page_bytes: int


class PagePool:
    """Fixed-size pages carved from one budget; every page is free or held by exactly one owner.

    Thread-safe: the server calls it from its asyncio loop and from compute threads.
    """

    def __init__(self, total_bytes: int, page_bytes: int = DEFAULT_PAGE_BYTES) -> None:
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        if total_bytes < 0:
            raise ValueError(f"total_bytes must be non-negative, got {total_bytes}")
        self.page_bytes = page_bytes
        self.pages_total = total_bytes // page_bytes
        self._lock = threading.Lock()
        self._owner_by_page: list[Owner | None] = [None] * self.pages_total
        self._pages_by_owner: dict[Owner, tuple[int, ...]] = {}
        # A min-heap so allocations always take the lowest free indices: deterministic layouts.
        self._free_pages: list[int] = list(range(self.pages_total))

    def pages_needed(self, nbytes: int) -> int:
        """Gives how many pages hold `nbytes` bytes (rounded up)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        return math.ceil(nbytes / self.page_bytes)

    def allocate(self, owner: Owner, n_pages: int) -> tuple[int, ...]:
        """Gives `n_pages` page indices now held by `owner`, lowest free first; all or nothing."""
        if n_pages <= 0:
            raise ValueError(f"n_pages must be positive, got {n_pages}")
        with self._lock:
            if owner in self._pages_by_owner:
                raise ValueError(f"{owner} already holds {len(self._pages_by_owner[owner])} pages; free them first")
            if n_pages > len(self._free_pages):
                raise OutOfPages(
                    f"{owner} needs {n_pages} pages ({n_pages * self.page_bytes} bytes) but only "
                    f"{len(self._free_pages)} of {self.pages_total} are free"
                )
            pages = tuple(heapq.heappop(self._free_pages) for _ in range(n_pages))
            for page in pages:
                self._owner_by_page[page] = owner
            self._pages_by_owner[owner] = pages
            return pages

    def free(self, owner: Owner) -> int:
        """Gives the number of pages `owner` held, now returned to the free list (0 if it held none)."""
        with self._lock:
            return self._free_locked(owner)

    def free_session(self, session_id: str) -> int:
        """Gives the number of pages freed across every block's KV cache of one session."""
        with self._lock:
            session_owners = [
                owner for owner in self._pages_by_owner if isinstance(owner, KVOwner) and owner.session_id == session_id
            ]
            return sum(self._free_locked(owner) for owner in session_owners)

    def _free_locked(self, owner: Owner) -> int:
        pages = self._pages_by_owner.pop(owner, ())
        for page in pages:
            self._owner_by_page[page] = None
            heapq.heappush(self._free_pages, page)
        return len(pages)

    def owner_of(self, page: int) -> Owner | None:
        """Gives the owner of one page, or None if it is free."""
        if not 0 <= page < self.pages_total:
            raise IndexError(f"page {page} is outside the pool (0..{self.pages_total - 1})")
        with self._lock:
            return self._owner_by_page[page]

    def pages_of(self, owner: Owner) -> tuple[int, ...]:
        """Gives the pages `owner` holds (empty if none)."""
        with self._lock:
            return self._pages_by_owner.get(owner, ())

    def owners(self) -> dict[Owner, tuple[int, ...]]:
        """Gives a snapshot of every owner and its pages."""
        with self._lock:
            return dict(self._pages_by_owner)

    def stats(self) -> PoolStats:
        """Gives a consistent snapshot of page counts by kind."""
        with self._lock:
            held = self._pages_by_owner.items()
            pages_params = sum(len(pages) for owner, pages in held if isinstance(owner, ParamsOwner))
            pages_kv = sum(len(pages) for owner, pages in held if isinstance(owner, KVOwner))
            return PoolStats(
                pages_total=self.pages_total,
                pages_params=pages_params,
                pages_kv=pages_kv,
                pages_free=len(self._free_pages),
                page_bytes=self.page_bytes,
            )

    def check_invariants(self) -> None:
        """Raises AssertionError unless every page is free xor held by exactly one owner and all counts agree."""
        with self._lock:
            free_set = set(self._free_pages)
            assert len(free_set) == len(self._free_pages), "free list holds a page twice"
            assert all(0 <= page < self.pages_total for page in free_set), "free list holds an out-of-range page"
            holders: dict[int, Owner] = {}
            for owner, pages in self._pages_by_owner.items():
                assert pages, f"{owner} is registered with no pages"
                for page in pages:
                    assert page not in holders, f"page {page} held by both {holders[page]} and {owner}"
                    assert page not in free_set, f"page {page} is both free and held by {owner}"
                    assert self._owner_by_page[page] == owner, f"page {page} index disagrees about {owner}"
                    holders[page] = owner
            for page, owner in enumerate(self._owner_by_page):
                assert (owner is None) == (page in free_set), f"page {page} is neither free nor owned (or both)"
            assert len(holders) + len(free_set) == self.pages_total, "owned + free pages do not add up to the total"
