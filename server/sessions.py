"""Inference sessions of one server: their KV pages in the pool, positions, duplicate-step replies and timeouts."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from swarm.errors import BlocksNotHosted, MaxLengthExceeded, OutOfPages, ServerBusy, SessionNotFound
from swarm.memory import KVOwner, PagePool
from swarm.model import BlockRange, KVCache


@dataclass(frozen=True)
class StepResult:
    """A computed step: the hidden states after the session's last block and the compute time it took."""

    output: torch.Tensor
    compute_ms: float


@dataclass
class RunningStep:
    """The step a session is computing now; a copy of the same step (client and push) awaits its result."""

    step_id: str | None
    result: asyncio.Future[StepResult]


@dataclass
class Session:
    """One client's attention state for blocks [start, end) of this server, reserved up to `max_length` tokens."""

    session_id: str
    start: int
    end: int
    batch: int
    max_length: int
    caches: dict[int, KVCache]
    position: int = 0
    last_step_id: str | None = None
    last_result: StepResult | None = None
    running: RunningStep | None = None  # touched only on the event loop thread
    computing: int = 0  # compute threads using `caches` now; the pages stay the session's until it drops to 0
    closed: bool = False
    # Resolved (and replaced) whenever a step is admitted, for requests waiting for a pushed step.
    admitted: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    last_active_s: float = field(default_factory=time.monotonic)


class SessionTable:
    """Opens, finds and closes sessions; every session's KV lives in pages of the server's one pool."""

    def __init__(self, blocks: BlockRange, pool: PagePool, *, max_length: int) -> None:
        self.blocks = blocks
        self.pool = pool
        self.max_length = max_length
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def kv_pages_per_block(self, batch: int, max_length: int) -> int:
        """Gives the pages one block's cache takes for a session of `batch` sequences up to `max_length` tokens."""
        return self.pool.pages_needed(self.blocks.kv_cache_bytes(batch=batch, capacity=max_length))

    def open(self, session_id: str, start: int, end: int, *, batch: int, max_length: int) -> Session:
        """Gives a new session with its KV pages reserved, or raises a typed error and reserves nothing."""
        if not (self.blocks.start <= start < end <= self.blocks.end):
            raise BlocksNotHosted(
                f"blocks {start}:{end} requested, but this server hosts {self.blocks.start}:{self.blocks.end}"
            )
        if not 0 < max_length <= self.max_length:
            raise MaxLengthExceeded(f"max_length {max_length} is outside 1..{self.max_length} (the server's limit)")
        if not 0 < batch <= 64:
            raise MaxLengthExceeded(f"batch {batch} is outside 1..64")
        pages_per_block = self.kv_pages_per_block(batch, max_length)
        with self._lock:
            if session_id in self._sessions or self.pool.has_session(session_id):
                raise ServerBusy(f"session {session_id!r} is already open on this server, or still closing")
            try:
                for block in range(start, end):
                    self.pool.allocate(KVOwner(session_id, block), pages_per_block)
            except OutOfPages as error:
                self.pool.free_session(session_id)
                message = f"no room for a session of {max_length} tokens x {end - start} blocks: {error}"
                raise ServerBusy(message) from None
            session = Session(session_id, start, end, batch, max_length, caches={})
            self._sessions[session_id] = session
        try:
            buffers = {block: self.pool.buffer(KVOwner(session_id, block)) for block in range(start, end)}
            session.caches = self.blocks.new_caches(start, end, batch=batch, capacity=max_length, buffers=buffers)
        except BaseException:
            self.close(session_id)
            raise
        return session

    def get(self, session_id: str) -> Session:
        """Gives the open session `session_id`, or raises SessionNotFound."""
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} is not open on this server (unknown, closed or timed out)")
        return session

    def is_open(self, session: Session) -> bool:
        """Gives whether `session` is still open (not closed, timed out or replaced)."""
        return self._sessions.get(session.session_id) is session

    def close(self, session_id: str) -> bool:
        """Closes a session and frees its pages, or, while a compute thread still uses them, lets the last such
        thread free them (see `computing_with`); gives False if it was not open."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return False
            session.closed = True
            if session.computing == 0:
                self._free_locked(session)
        session.last_result = None
        return True

    @contextmanager
    def computing_with(self, session: Session) -> Iterator[dict[int, KVCache]]:
        """Gives a compute thread the session's caches, which keep their pages until it is done, even if the session
        closes meanwhile (the pages are then freed here); raises SessionNotFound if it is already closed."""
        with self._lock:
            if session.closed:
                raise SessionNotFound(f"session {session.session_id!r} closed before its step could run")
            session.computing += 1
            caches = session.caches
        try:
            yield caches
        finally:
            with self._lock:
                session.computing -= 1
                if session.closed and session.computing == 0:
                    self._free_locked(session)

    def _free_locked(self, session: Session) -> None:
        self.pool.free_session(session.session_id)
        session.caches = {}

    def close_idle(self, idle_timeout_s: float) -> list[str]:
        """Closes the sessions idle for longer than `idle_timeout_s` and not running a step; gives their ids."""
        now = time.monotonic()
        expired = [
            s.session_id for s in list(self._sessions.values())
            if s.running is None and now - s.last_active_s > idle_timeout_s
        ]
        return [session_id for session_id in expired if self.close(session_id)]

    def close_all(self) -> int:
        """Closes every session; gives how many were open."""
        return sum(self.close(session_id) for session_id in list(self._sessions))
