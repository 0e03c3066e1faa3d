"""The slot pool: one memory budget split into fixed-size pages, each free or held by exactly one owner."""

from __future__ import annotations

import bisect
import math
import mmap
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import psutil
import torch

from swarm.errors import OutOfPages

DEFAULT_PAGE_BYTES = 1 << 20
# The pool's buffer is allocated up front; on CUDA, what it leaves holds a block while it is built (before it moves
# into its pages), bitsandbytes' state and prefill activations.
CUDA_BUDGET_FRACTION = 0.8
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
    """Gives the pool budget when none is configured: 80% of free CUDA memory, or half of available host RAM."""
    if device.type == "cuda":
        free_bytes, _total_bytes = torch.cuda.mem_get_info(device)
        return int(free_bytes * CUDA_BUDGET_FRACTION)
    if device.type == "cpu":
        return int(psutil.virtual_memory().available * CPU_BUDGET_FRACTION)
    raise ValueError(f"no default memory budget for device type {device.type!r}; pass an explicit size")


def kv_bytes_per_token(*, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Gives the KV bytes one token of one sequence takes in one block (keys and values)."""
    return 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def kv_tokens_per_page(page_bytes: int, bytes_per_token: int) -> int:
    """Gives how many tokens of one sequence's KV for one block one page holds."""
    return page_bytes // bytes_per_token if bytes_per_token > 0 else 0


def kv_pages_for(tokens: int, tokens_per_page: int) -> int:
    """Gives the pages one sequence's KV for one block takes at `tokens` tokens (at least one)."""
    return max(1, -(-tokens // tokens_per_page))


@dataclass(frozen=True)
class ParamsOwner:
    """The parameters of one hosted block."""

    block: int


@dataclass(frozen=True)
class KVOwner:
    """One session's KV cache for one block; `lent`: what a server lends a peer of it after its own part of the
    session left the block (KunServe's live exchange, `server.remote_attention`), no longer the session's."""

    session_id: str
    block: int
    lent: bool = False


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
    """Fixed-size pages of one memory budget; every page is free or held by exactly one owner.

    The pages are real memory: one buffer of `pages_total * page_bytes` bytes on the pool's device (on CPU an
    anonymous mapping that the kernel may back with transparent huge pages, committed only as pages are touched).
    A block's parameters hold one contiguous run of pages (`allocate`, `adopt`), so its tensors are views into the
    buffer. A session's KV for one block holds pages one by one as it grows (`take`), wherever they are free, as
    vLLM's block pool does: KV never needs a contiguous run. Runs are cut from the lowest free pages and KV pages
    are taken from the highest, so KV churn leaves long runs for parameters.

    Thread-safe: the server calls it from its asyncio loop and from compute threads.
    """

    def __init__(self, total_bytes: int, page_bytes: int = DEFAULT_PAGE_BYTES, *, device: torch.device | str = "cpu"):
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        if total_bytes < 0:
            raise ValueError(f"total_bytes must be non-negative, got {total_bytes}")
        self.page_bytes = page_bytes
        self.pages_total = total_bytes // page_bytes
        self.device = torch.device(device)
        self.storage = _page_buffer(self.pages_total * page_bytes, self.device)
        self._lock = threading.Lock()
        self._owner_by_page: list[Owner | None] = [None] * self.pages_total
        self._pages_by_owner: dict[Owner, list[int]] = {}
        # Free runs as sorted (start, length), coalesced: first fit gives the lowest run, a deterministic layout.
        self._free_runs: list[tuple[int, int]] = [(0, self.pages_total)] if self.pages_total else []
        self._pages_free = self.pages_total
        self._pages_params = 0

    @property
    def pages_free(self) -> int:
        return self._pages_free

    @property
    def pages_for_kv(self) -> int:
        """Gives the pages not held by parameters: what KV can hold at most now."""
        return self.pages_total - self._pages_params

    def pages_needed(self, nbytes: int) -> int:
        """Gives how many pages hold `nbytes` bytes (rounded up)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        return math.ceil(nbytes / self.page_bytes)

    def allocate(self, owner: Owner, n_pages: int) -> tuple[int, ...]:
        """Gives the `n_pages` contiguous page indices now held by `owner`, from the lowest run that fits."""
        if n_pages <= 0:
            raise ValueError(f"n_pages must be positive, got {n_pages}")
        with self._lock:
            if owner in self._pages_by_owner:
                held = len(self._pages_by_owner[owner])
                raise ValueError(f"{owner} already holds {held} pages; free them first")
            index = next((i for i, (_, length) in enumerate(self._free_runs) if length >= n_pages), None)
            if index is None:
                fragmented = "" if n_pages > self._pages_free else f", and no {n_pages} of them are contiguous"
                raise OutOfPages(
                    f"{owner} needs {n_pages} pages ({n_pages * self.page_bytes} bytes) but only "
                    f"{self._pages_free} of {self.pages_total} are free{fragmented}"
                )
            start, length = self._free_runs[index]
            if length == n_pages:
                del self._free_runs[index]
            else:
                self._free_runs[index] = (start + n_pages, length - n_pages)
            pages = list(range(start, start + n_pages))
            self._hold_locked(owner, pages)
            return tuple(pages)

    def take(self, owner: KVOwner, n_pages: int) -> tuple[int, ...]:
        """Gives `n_pages` more pages for `owner`, wherever they are free (the highest first), appended to the pages
        it holds; all or nothing."""
        if n_pages <= 0:
            raise ValueError(f"n_pages must be positive, got {n_pages}")
        with self._lock:
            if n_pages > self._pages_free:
                raise OutOfPages(
                    f"{owner} needs {n_pages} more page(s) but only {self._pages_free} of {self.pages_total} are free"
                )
            pages: list[int] = []
            while len(pages) < n_pages:
                start, length = self._free_runs[-1]
                count = min(length, n_pages - len(pages))
                pages.extend(range(start + length - 1, start + length - 1 - count, -1))
                if count == length:
                    self._free_runs.pop()
                else:
                    self._free_runs[-1] = (start, length - count)
            self._hold_locked(owner, pages)
            return tuple(pages)

    def _hold_locked(self, owner: Owner, pages: list[int]) -> None:
        for page in pages:
            self._owner_by_page[page] = owner
        self._pages_by_owner.setdefault(owner, []).extend(pages)
        self._pages_free -= len(pages)
        if isinstance(owner, ParamsOwner):
            self._pages_params += len(pages)

    def free(self, owner: Owner) -> int:
        """Gives the number of pages `owner` held, now returned to the free list (0 if it held none)."""
        with self._lock:
            return self._free_locked(owner)

    def reown(self, owner: KVOwner, new_owner: KVOwner) -> int:
        """Hands every page `owner` holds to `new_owner` (which holds none), in the same order, no bytes copied; gives
        how many (KV lent to a peer outlives its session's part here: `server.remote_attention`)."""
        with self._lock:
            if new_owner in self._pages_by_owner:
                raise ValueError(f"{new_owner} already holds pages")
            pages = self._pages_by_owner.pop(owner, [])
            if pages:
                self._pages_by_owner[new_owner] = pages
            for page in pages:
                self._owner_by_page[page] = new_owner
            return len(pages)

    def free_session(self, session_id: str) -> int:
        """Gives the number of pages freed across every block's KV cache of one session."""
        with self._lock:
            session_owners = [
                owner for owner in self._pages_by_owner
                if isinstance(owner, KVOwner) and owner.session_id == session_id and not owner.lent
            ]
            return sum(self._free_locked(owner) for owner in session_owners)

    def has_session(self, session_id: str) -> bool:
        """Gives whether any page holds KV of session `session_id`."""
        with self._lock:
            return any(isinstance(owner, KVOwner) and owner.session_id == session_id and not owner.lent
                       for owner in self._pages_by_owner)

    def _free_locked(self, owner: Owner) -> int:
        pages = self._pages_by_owner.pop(owner, None)
        if pages is None:
            return 0
        for page in pages:
            self._owner_by_page[page] = None
        self._pages_free += len(pages)
        if isinstance(owner, ParamsOwner):
            self._pages_params -= len(pages)
        for start, length in _runs_of(sorted(pages)):
            self._insert_free_run_locked(start, length)
        return len(pages)

    def _insert_free_run_locked(self, start: int, length: int) -> None:
        index = bisect.bisect(self._free_runs, (start, 0))
        if index < len(self._free_runs) and self._free_runs[index][0] == start + length:  # merge with the next run
            length += self._free_runs.pop(index)[1]
        if index > 0 and sum(self._free_runs[index - 1]) == start:  # and with the previous one
            start, previous_length = self._free_runs.pop(index - 1)
            length += previous_length
            index -= 1
        self._free_runs.insert(index, (start, length))

    def buffer(self, owner: Owner) -> torch.Tensor:
        """Gives the bytes of `owner`'s pages: a uint8 view into the pool's memory (raises KeyError if it has none,
        ValueError if its pages are not one run)."""
        with self._lock:
            pages = self._pages_by_owner[owner]
        first = pages[0]
        if pages != list(range(first, first + len(pages))):
            raise ValueError(f"{owner} does not hold one run of pages")
        return self.storage[first * self.page_bytes : (first + len(pages)) * self.page_bytes]

    def adopt(self, owner: Owner, tensors: list[torch.Tensor], *, min_pages: int = 1) -> tuple[int, ...]:
        """Gives the pages that now hold `tensors` (at least `min_pages`): allocates them, copies each tensor in and
        repoints it there.

        Each tensor (a parameter or buffer) keeps its identity, dtype and shape; only its storage moves into the
        pool, so a module that holds it computes from pool memory from now on.
        """
        offsets, nbytes = _packed_layout(tensors)
        pages = self.allocate(owner, max(1, min_pages, self.pages_needed(nbytes)))
        run = self.buffer(owner)
        for tensor, offset in zip(tensors, offsets, strict=True):
            size = tensor.numel() * tensor.element_size()
            view = run[offset : offset + size].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            tensor.data = view
        return pages

    def largest_free_run(self) -> int:
        """Gives the length of the longest run of free pages (0 if none is free)."""
        with self._lock:
            return max((length for _, length in self._free_runs), default=0)

    def clearable_window(self, n_pages: int, movable: Callable[[Owner], bool]) -> tuple[int, int] | None:
        """Gives the window [start, start + n_pages) of pages, each free or held by a `movable` owner, that holds
        the fewest held pages while the free pages outside it can take them all (None if no window can be cleared);
        a run for parameters once its pages moved out (`move_page`)."""
        with self._lock:
            pages = self._owner_by_page
            if n_pages <= 0 or n_pages > self.pages_total or self._pages_free < n_pages:
                return None
            best: tuple[int, int] | None = None
            held = blocked = 0
            for page in range(self.pages_total):
                owner = pages[page]
                held += owner is not None
                blocked += owner is not None and not movable(owner)
                if page >= n_pages:
                    leaving = pages[page - n_pages]
                    held -= leaving is not None
                    blocked -= leaving is not None and not movable(leaving)
                if page >= n_pages - 1 and not blocked and (best is None or held < best[1]):
                    best = (page - n_pages + 1, held)
            return None if best is None else (best[0], best[0] + n_pages)

    def move_page(self, page: int, *, outside: tuple[int, int]) -> int:
        """Moves the KV page `page` to a free page outside [outside[0], outside[1]) (the highest one): copies its
        bytes and hands it over in its owner's order; gives the new page. The caller points the page tables that
        named `page` at the new one, while no batch reads them."""
        with self._lock:
            owner = self._owner_by_page[page]
            if not isinstance(owner, KVOwner):
                raise ValueError(f"page {page} holds no KV (its owner is {owner})")
            found = None
            for index in range(len(self._free_runs) - 1, -1, -1):
                start, length = self._free_runs[index]
                top = start + length - 1
                candidate = outside[0] - 1 if outside[0] <= top < outside[1] else top
                if candidate >= start:
                    found = index, start, top, candidate
                    break
            if found is None:
                raise OutOfPages(f"no free page outside pages {outside[0]}:{outside[1]} to move page {page} to")
            index, start, top, target = found
            del self._free_runs[index]
            for first, count in ((start, target - start), (target + 1, top - target)):
                if count > 0:
                    self._insert_free_run_locked(first, count)
            self.storage[target * self.page_bytes : (target + 1) * self.page_bytes].copy_(
                self.storage[page * self.page_bytes : (page + 1) * self.page_bytes])
            held = self._pages_by_owner[owner]
            held[held.index(page)] = target
            self._owner_by_page[target], self._owner_by_page[page] = owner, None
            self._insert_free_run_locked(page, 1)
            return target

    def owner_of(self, page: int) -> Owner | None:
        """Gives the owner of one page, or None if it is free."""
        if not 0 <= page < self.pages_total:
            raise IndexError(f"page {page} is outside the pool (0..{self.pages_total - 1})")
        with self._lock:
            return self._owner_by_page[page]

    def pages_of(self, owner: Owner) -> tuple[int, ...]:
        """Gives the pages `owner` holds, in the order it took them (empty if none)."""
        with self._lock:
            return tuple(self._pages_by_owner.get(owner, ()))

    def owners(self) -> dict[Owner, tuple[int, ...]]:
        """Gives a snapshot of every owner and its pages."""
        with self._lock:
            return {owner: tuple(pages) for owner, pages in self._pages_by_owner.items()}

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
                pages_free=self._pages_free,
                page_bytes=self.page_bytes,
            )

    def check_invariants(self) -> None:
        """Raises AssertionError unless every page is free xor held by exactly one owner, all counts agree and every
        parameter owner holds one run."""
        with self._lock:
            free_set: set[int] = set()
            previous_end = -1
            for start, length in self._free_runs:
                assert length > 0, "a free run is empty"
                assert start > previous_end, "free runs overlap, touch without merging, or are out of order"
                free_set.update(range(start, start + length))
                previous_end = start + length
            assert previous_end <= self.pages_total, "a free run ends outside the pool"
            assert len(free_set) == self._pages_free, "the free page count disagrees with the free runs"
            holders: dict[int, Owner] = {}
            for owner, pages in self._pages_by_owner.items():
                assert pages, f"{owner} is registered with no pages"
                if isinstance(owner, ParamsOwner):
                    assert pages == list(range(pages[0], pages[0] + len(pages))), f"{owner} holds no single run"
                for page in pages:
                    assert page not in holders, f"page {page} held by both {holders[page]} and {owner}"
                    assert page not in free_set, f"page {page} is both free and held by {owner}"
                    assert self._owner_by_page[page] == owner, f"page {page} index disagrees about {owner}"
                    holders[page] = owner
            for page, owner in enumerate(self._owner_by_page):
                assert (owner is None) == (page in free_set), f"page {page} is neither free nor owned (or both)"
            assert len(holders) + len(free_set) == self.pages_total, "owned + free pages do not add up to the total"
            params = sum(len(pages) for owner, pages in self._pages_by_owner.items() if isinstance(owner, ParamsOwner))
            assert params == self._pages_params, "the parameter page count disagrees with the owners"


def _runs_of(sorted_pages: list[int]) -> list[tuple[int, int]]:
    """Gives (start, length) of each run of consecutive pages in `sorted_pages`."""
    runs: list[tuple[int, int]] = []
    for page in sorted_pages:
        if runs and sum(runs[-1]) == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


TENSOR_ALIGN_BYTES = 64  # cache-line and SIMD alignment of every tensor placed in the pool


def _packed_layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Gives each tensor's byte offset when packed in order with aligned starts, and the total bytes."""
    offsets, nbytes = [], 0
    for tensor in tensors:
        nbytes = -(-nbytes // TENSOR_ALIGN_BYTES) * TENSOR_ALIGN_BYTES
        offsets.append(nbytes)
        nbytes += tensor.numel() * tensor.element_size()
    return offsets, nbytes


def packed_bytes(tensors: list[torch.Tensor]) -> int:
    """Gives the bytes `tensors` take when adopted by a pool (aligned starts included)."""
    return _packed_layout(tensors)[1]


def _page_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Gives `nbytes` of uninitialized memory on `device` as a uint8 tensor.

    On CPU: an anonymous private mapping (no swap reserved, committed page by page as it is touched) advised for
    transparent huge pages, so the weights a step streams through cost few TLB misses even after the server sat
    idle. On CUDA: one allocation up front, as inference servers reserve their KV memory.
    """
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
