"""A session's KV pages stay its own while a compute thread uses them, even if the session closes meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch

from server.sessions import SessionTable
from swarm.errors import ServerBusy, SessionNotFound
from swarm.memory import KVOwner, PagePool
from swarm.model import BlockRange, resolve_model

PAGE_BYTES = 4096


def table(tiny_llama: Path, *, sessions_that_fit: int) -> SessionTable:
    blocks = BlockRange(resolve_model(str(tiny_llama)), 0, 2)
    per_session = 2 * PagePool(PAGE_BYTES, PAGE_BYTES).pages_needed(blocks.kv_cache_bytes(batch=1, capacity=16))
    return SessionTable(blocks, PagePool(sessions_that_fit * per_session * PAGE_BYTES, PAGE_BYTES), max_length=16)


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())  # sessions create asyncio futures, so they are opened inside a running loop


def test_closing_mid_step_keeps_the_pages_until_the_step_ends(tiny_llama: Path) -> None:
    async def scenario() -> None:
        sessions = table(tiny_llama, sessions_that_fit=1)
        first = sessions.open("a", 0, 2, batch=1, max_length=16)
        pages = sessions.pool.pages_of(KVOwner("a", 0))
        with sessions.computing_with(first) as caches:
            assert sessions.close("a")
            assert sessions.pool.pages_of(KVOwner("a", 0)) == pages  # still the running step's
            with pytest.raises(ServerBusy):  # nobody else gets them meanwhile, nor the same id
                sessions.open("b", 0, 2, batch=1, max_length=16)
            with pytest.raises(ServerBusy):
                sessions.open("a", 0, 2, batch=1, max_length=16)
            sessions.blocks.forward(torch.ones(1, 1, 64), caches, 0)  # the step writes its KV into them
        assert not sessions.pool.has_session("a")
        sessions.pool.check_invariants()
        assert sessions.open("b", 0, 2, batch=1, max_length=16).caches  # the freed pages serve the next session

    run(scenario)


def test_a_closed_session_starts_no_step_and_close_frees_an_idle_one_at_once(tiny_llama: Path) -> None:
    async def scenario() -> None:
        sessions = table(tiny_llama, sessions_that_fit=2)
        session = sessions.open("a", 0, 2, batch=1, max_length=16)
        assert sessions.close("a") and not sessions.close("a")
        assert not sessions.pool.has_session("a") and session.caches == {}
        with pytest.raises(SessionNotFound), sessions.computing_with(session):
            pass

    run(scenario)


def test_idle_expiry_skips_a_session_that_is_running_a_step(tiny_llama: Path) -> None:
    async def scenario() -> None:
        sessions = table(tiny_llama, sessions_that_fit=2)
        busy, idle = (sessions.open(name, 0, 2, batch=1, max_length=16) for name in ("busy", "idle"))
        busy.running = object()  # type: ignore[assignment]  # what the server sets while a step is admitted
        busy.last_active_s = idle.last_active_s = 0.0
        assert sessions.close_idle(idle_timeout_s=1.0) == ["idle"]
        assert sessions.get("busy") is busy

    run(scenario)
