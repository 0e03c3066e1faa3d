"""The hosting core: which blocks a server has loaded, which take new sessions, and moving from one range to another
while sessions keep running.

The serving range [start, end) is contiguous: new sessions open there only. Changing it to [new_start, new_end):
1. the blocks that leave stop taking new sessions at once (the serving range shrinks to what both ranges share);
2. the blocks that arrive are loaded one by one into free pages of the pool, nearest to the kept range first, each
   only while the pages left still cover the running sessions' expected growth (the headroom rule); when they do
   not, loading waits for leaving blocks to free their pages;
3. the serving range becomes the new one;
4. each leaving block is unloaded, and its pages return to the pool, once no session (open, or closed while a batch
   still computes with it) uses it: running sessions finish where they are.
Listeners hear every change of the serving range at once (the server re-announces its record and prints it).

Dropping (KunServe) is a shrink that cannot wait for the running sessions: the sessions that use a dropped block are
evicted with `BlocksDropped` (their clients replay them through the servers that keep those blocks), and the dropped
blocks unload as soon as no batch computes with them, so that their pages hold KV at once. The range served before
the first drop stays `restorable` until `restore` loads it back (from the local checkpoint) or a `change` moves the
server elsewhere. A block's parameters need one run of contiguous pages: when enough pages are free but scattered
among KV pages (sessions took the dropped blocks' pages), loading first moves the KV pages in the way of the cheapest
run to free pages elsewhere (`SessionTable.make_run`), page tables and all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from server.sessions import SessionTable
from swarm.errors import BlocksDropped, InvalidBlockRange, OutOfPages
from swarm.memory import PagePool, ParamsOwner
from swarm.model import BlockRange

log = logging.getLogger(__name__)

RangeListener = Callable[[tuple[int, int], tuple[int, int]], None]
RETIRE_POLL_S = 0.1


class Hosting:
    """Owns the serving range of one server's blocks and the changes of it; runs on the server's event loop."""

    def __init__(
        self, blocks: BlockRange, pool: PagePool, sessions: SessionTable, *, load_timeout_s: float = 600.0
    ) -> None:
        self.blocks, self.pool, self.sessions = blocks, pool, sessions
        self.load_timeout_s = load_timeout_s
        loaded = blocks.loaded
        self.start, self.end = (loaded[0], loaded[-1] + 1) if loaded else (0, 0)
        if loaded != list(range(self.start, self.end)):
            raise InvalidBlockRange(f"a server starts with a contiguous range of blocks, got {loaded}")
        self.sessions.set_range(self.start, self.end)
        self._retiring: set[int] = set()
        # the retiring blocks a drop left: they return their pages once no batch computes over them and the victims
        # left, within seconds (a range change's leaving blocks wait for their sessions to end)
        self._dropped: set[int] = set()
        self._freed = asyncio.Event()  # set whenever a leaving block returns its pages
        self._lock = asyncio.Lock()  # one change at a time
        self._listeners: list[RangeListener] = []
        self._retire_task: asyncio.Task[None] | None = None
        self._restorable: tuple[int, int] | None = None
        self.drops = 0
        self.restores = 0

    @property
    def serving(self) -> tuple[int, int]:
        return self.start, self.end

    @property
    def restorable(self) -> tuple[int, int] | None:
        """Gives the range served before the first drop since the last restore (None: nothing dropped)."""
        return self._restorable

    @property
    def retiring(self) -> list[int]:
        """Gives the blocks that take no new sessions and wait for their running ones to finish, in order."""
        return sorted(self._retiring)

    def add_listener(self, listener: RangeListener) -> None:
        """Calls `listener(old, new)` whenever the serving range changes."""
        self._listeners.append(listener)

    async def change(self, start: int, end: int) -> None:
        """Moves the serving range to [start, end): returns once it serves there; leaving blocks unload later.

        Raises InvalidBlockRange for a range outside the model, OutOfPages when the new blocks do not fit even
        after the leaving ones are gone (the blocks this change loaded are unloaded again; the range served is then
        what both ranges share)."""
        if not 0 <= start < end <= self.blocks.num_blocks:
            raise InvalidBlockRange(f"blocks {start}:{end} are not a range of the model's {self.blocks.num_blocks}")
        async with self._lock:
            if (start, end) == (self.start, self.end):
                return
            kept_start, kept_end = max(start, self.start), min(end, self.end)
            leaving = set(range(self.start, self.end)) - set(range(start, end))
            self._retiring |= leaving
            self._retiring -= set(range(start, end))  # a block that left and comes back serves again at once
            self._dropped -= set(range(start, end))
            self._set_range(*((kept_start, kept_end) if kept_start < kept_end else (0, 0)))
            self._ensure_retire_task()
            # nearest to the kept range first: below it downwards, then above it upwards
            pivot = kept_start if kept_start < kept_end else start
            arriving = [*range(pivot - 1, start - 1, -1), *range(pivot, end)]
            loaded_now = []
            try:
                for index in arriving:
                    if index not in self.blocks.loaded:
                        await self._load(index, leaving_blocks=leaving)
                        loaded_now.append(index)
            except BaseException:
                for index in loaded_now:  # what this change loaded but will not serve goes back to the pool
                    self.blocks.unload_block(index)
                    self.pool.free(ParamsOwner(index))
                raise
            self._set_range(start, end)
            self._restorable = None

    async def drop(self, start: int, end: int, *, evict: bool = True) -> list[str]:
        """Keeps only [start, end) of the serving range, at once; gives the ids of the sessions that use a dropped
        block (the victims), evicted unless `evict` is False (their KV then moves to the servers that keep those
        blocks: `server.exchange`; the blocks unload once no victim computes over them: at once under a blocking
        exchange, whose victims wait for their KV to move). Raises InvalidBlockRange
        unless [start, end) is a non-empty part of the range."""
        async with self._lock:
            if not self.start <= start < end <= self.end:
                raise InvalidBlockRange(
                    f"a drop keeps a non-empty part of the served blocks {self.start}:{self.end}, not {start}:{end}"
                )
            if (start, end) == (self.start, self.end):
                return []
            dropped = set(range(self.start, self.end)) - set(range(start, end))
            pages = sum(len(self.pool.pages_of(ParamsOwner(index))) for index in dropped)
            victims = [session.session_id for session in self.sessions
                       if any(session.start <= index < session.end for index in dropped)]
            for session_id in victims if evict else ():
                self.sessions.evict(session_id, BlocksDropped(
                    f"this server dropped blocks of session {session_id!r} to hold more KV and keeps {start}:{end} "
                    f"only; continue through the servers that keep the others"
                ))
            if self._restorable is None:
                self._restorable = (self.start, self.end)
            old = (self.start, self.end)
            self._retiring |= dropped
            self._dropped |= dropped
            self._set_range(start, end)
            self.drops += 1
            self.unload_unused()  # what no batch computes with goes now, the rest once its batch ends
            self._ensure_retire_task()
            log.info("Dropped blocks %d:%d -> %d:%d: %d parameter pages freed for KV, %d session(s) %s",
                     *old, start, end, pages, len(victims), "evicted" if evict else "to exchange")
            return victims

    async def restore(self, *, evict_merged: bool = False) -> list[str]:
        """Loads the dropped blocks back and serves the range from before the drop again (nothing dropped: does
        nothing); gives the sessions it evicted. Raises OutOfPages as `change` does; the server then still serves
        what it kept.

        With `evict_merged` (a buddy that kept other blocks of the segment is gone), the sessions that went through
        this server's kept blocks only, as part of the group's chain, are evicted first: their chains are broken,
        their clients replay them anyway, and the pages they hold are what the blocks need to come back."""
        target = self._restorable
        if target is None:
            return []
        evicted = []
        if evict_merged:
            evicted = [session.session_id for session in self.sessions if (session.start, session.end) != target]
            for session_id in evicted:
                self.sessions.evict(session_id, BlocksDropped(
                    f"a server that kept other blocks of session {session_id!r} left; this one loads blocks "
                    f"{target[0]}:{target[1]} back: continue through it"
                ))
        before = self.pool.stats().pages_params
        await self.change(*target)
        self.restores += 1
        log.info("Restored blocks %d:%d: %d parameter pages taken, %d session(s) evicted", *target,
                 self.pool.stats().pages_params - before, len(evicted))
        return evicted

    async def _load(self, index: int, *, leaving_blocks: set[int]) -> None:
        """Loads block `index` into the pool once its pages fit beside the running sessions' expected growth."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.load_timeout_s
        while not self._fits_one_more_block() and self._retiring & leaving_blocks:
            self._freed.clear()
            remaining_s = deadline - loop.time()
            if remaining_s <= 0:
                break
            try:  # a leaving block returns its pages once its sessions end
                await asyncio.wait_for(self._freed.wait(), remaining_s)
            except TimeoutError:
                break
        if not self._fits_one_more_block():
            stats = self.pool.stats()
            raise OutOfPages(
                f"cannot load block {index}: {stats.pages_free} pages are free and the running sessions are expected "
                f"to take {self.sessions.growth_reserve()} of them as they grow"
            )
        pages = self._pages_per_block()
        if pages and self.pool.largest_free_run() < pages and self.sessions.make_run(pages):
            log.info("Moved KV pages to free a run of %d pages for block %d", pages, index)
        try:
            await asyncio.to_thread(self.blocks.load_block, index)
        except OutOfPages as error:
            raise OutOfPages(f"cannot load block {index}: {error.message}") from None
        log.info("Loaded block %d; pool %s", index, self.pool.stats())

    def _fits_one_more_block(self) -> bool:
        """Gives whether one more block's parameters leave the pages the running sessions are expected to grow
        into (a block's size is known from the blocks loaded so far; with none loaded, loading just tries)."""
        pages_per_block = self._pages_per_block()
        if not pages_per_block:
            return True
        return self.pool.pages_free - pages_per_block >= self.sessions.growth_reserve()

    def _pages_per_block(self) -> int:
        """Gives the pages one block's parameters take, from the blocks loaded (0 when none is)."""
        return max((len(self.pool.pages_of(ParamsOwner(index))) for index in self.blocks.loaded), default=0)

    def _set_range(self, start: int, end: int) -> None:
        old = (self.start, self.end)
        if old == (start, end):
            return
        self.start, self.end = start, end
        self.sessions.set_range(start, end)
        for listener in self._listeners:
            listener(old, (start, end))

    def _ensure_retire_task(self) -> None:
        if self._retire_task is None or self._retire_task.done():
            self._retire_task = asyncio.create_task(self._retire_loop(), name="retire-blocks")

    async def _retire_loop(self) -> None:
        while self._retiring:
            self.unload_unused()
            if self._retiring:
                await asyncio.sleep(RETIRE_POLL_S)

    def retiring_pages(self) -> int:
        """Gives the pages of dropped blocks that are still loaded: they return to the pool within seconds, once no
        batch computes over them and the victims left (a range change's leaving blocks, which wait for their
        sessions to end, do not count)."""
        return sum(len(self.pool.pages_of(ParamsOwner(index))) for index in self._retiring & self._dropped
                   if index in self.blocks.loaded)

    def unload_unused(self) -> list[int]:
        """Unloads every leaving block no session uses any more and returns its pages; gives their indices."""
        unloaded = []
        for index in sorted(self._retiring):
            if self.sessions.uses_block(index):
                continue
            self._retiring.discard(index)
            self._dropped.discard(index)
            if index in self.blocks.loaded:
                self.blocks.unload_block(index)
                self.pool.free(ParamsOwner(index))
                unloaded.append(index)
        if unloaded:
            self._freed.set()
            log.info("Unloaded block(s) %s; pool %s", unloaded, self.pool.stats())
        return unloaded

    async def stop(self) -> None:
        """Stops waiting for leaving blocks (the server shuts down; the pool goes with it)."""
        if self._retire_task is not None:
            self._retire_task.cancel()
            await asyncio.gather(self._retire_task, return_exceptions=True)
