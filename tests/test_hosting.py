"""The hosting core: a server's blocks load and unload while sessions run; leaving blocks take no new sessions and
return their pages once their sessions end; outputs stay those of transformers' layers throughout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from orchestrator.admission import BUSY_BACKOFF_FIRST_S, BUSY_BACKOFF_MAX_S, MIN_RETRY_S, busy_retry_wait
from server.hosting import Hosting
from server.scheduler import StepScheduler
from server.sessions import SOON_RETRY_MS, Session, SessionTable, Step, StepResult
from swarm.errors import BlocksDropped, BlocksNotHosted, InvalidBlockRange, OutOfPages, ServerBusy
from swarm.memory import KVOwner, PagePool, ParamsOwner
from swarm.model import BlockRange, resolve_model
from tests.reference import ReferenceBlocks

HIDDEN = 64
PAGE_TOKENS = 16


class Core:
    """A server's hosting core without the network: pool, blocks, sessions, scheduler and Hosting."""

    def __init__(self, model: Path, start: int, end: int, *, pool_blocks: float, kv_pages: int = 0) -> None:
        self.source = resolve_model(str(model))
        probe = BlockRange(self.source, 0, 1)
        self.page_bytes = PAGE_TOKENS * probe.kv_bytes_per_token()
        self.pages_per_block = -(-probe.block_bytes(0) // self.page_bytes) + 1  # aligned packing may need one more
        pages = int(pool_blocks * self.pages_per_block) + kv_pages
        self.pool = PagePool(pages * self.page_bytes, self.page_bytes)
        self.blocks = BlockRange(
            self.source, start, end, adopt=lambda index, tensors: self.pool.adopt(ParamsOwner(index), tensors)
        )
        kv = self.blocks.paged_kv(self.pool.storage, self.page_bytes)
        self.sessions = SessionTable(block_start=start, block_end=end, pool=self.pool,
                                     tokens_per_page=kv.tokens_per_page, max_length=256, headroom_tokens=0)
        self.scheduler = StepScheduler(self.blocks, kv, self.sessions, max_batch_tokens=64, inline_step_ms=0,
                                       block_compute_ms=1.0, on_steps_done=lambda steps: None)
        self.hosting = Hosting(self.blocks, self.pool, self.sessions, load_timeout_s=30)
        self.sessions.pages_coming = self.hosting.retiring_pages  # as the server wires them
        self.changes: list[tuple[tuple[int, int], tuple[int, int]]] = []
        self.hosting.add_listener(lambda old, new: self.changes.append((old, new)))
        self.references: dict[str, ReferenceBlocks] = {}
        self.generator = torch.Generator().manual_seed(0)

    def open(self, name: str, start: int, end: int) -> Session:
        session = self.sessions.open(name, start, end, batch=1, max_length=256)
        self.references[name] = ReferenceBlocks(self.source, start, end)
        return session

    async def step_exactly(self, session: Session, tokens: int) -> None:
        """Runs a step of random hidden states and checks its output against transformers' layers."""
        hidden = torch.randn(1, tokens, HIDDEN, generator=self.generator)
        self.sessions.grow(session, session.position + tokens)
        result: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        step = Step(session, f"{session.position}", hidden, result)
        session.running = step
        self.scheduler.submit(step)
        output = (await result).output
        torch.testing.assert_close(output, self.references[session.session_id](hidden), rtol=1e-5, atol=1e-5)

    async def computing(self, session: Session, tokens: int) -> asyncio.Future[StepResult]:
        """Starts a step of `tokens` random hidden states that computes for a while (0.1 s a block) and gives its
        result once its batch computes."""
        self.scheduler.hold_ms = lambda batch, block: 100.0  # each block of a batch takes 0.1 s: a wide window
        self.sessions.grow(session, session.position + tokens)
        result: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        session.running = Step(session, f"{session.position}",
                               torch.randn(1, tokens, HIDDEN, generator=self.generator), result)
        self.scheduler.submit(session.running)
        await until(lambda: session.in_batches > 0, timeout_s=5)
        return result

    def params_pages(self) -> dict[int, int]:
        return {owner.block: len(pages) for owner, pages in self.pool.owners().items()
                if isinstance(owner, ParamsOwner)}


def run(body: Callable[[], object]) -> None:
    async def main() -> None:
        try:
            await body()  # type: ignore[misc]
        finally:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

    asyncio.run(main())


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


def test_a_range_grows_shrinks_and_moves_while_its_sessions_keep_computing_exactly(tiny_llama: Path) -> None:
    async def body() -> None:
        core = Core(tiny_llama, 0, 4, pool_blocks=12, kv_pages=64)
        core.scheduler.start()
        old = core.open("old", 0, 4)
        await core.step_exactly(old, 5)

        await core.hosting.change(2, 8)  # shrink at the start, grow at the end
        assert core.hosting.serving == (2, 8) and core.hosting.retiring == [0, 1]
        assert core.changes == [((0, 4), (2, 4)), ((2, 4), (2, 8))]
        with pytest.raises(BlocksNotHosted):
            core.open("late", 0, 4)  # leaving blocks take no new session
        new = core.open("new", 2, 8)
        await core.step_exactly(new, 3)
        await core.step_exactly(old, 1)  # the running session finishes where it started
        await core.step_exactly(new, 1)
        assert sorted(core.params_pages()) == list(range(8))
        core.sessions.close("old")
        await until(lambda: core.hosting.retiring == [])
        assert sorted(core.params_pages()) == list(range(2, 8))

        await core.hosting.change(0, 2)  # a move: nothing in common, both loaded while `new` runs
        assert core.hosting.serving == (0, 2) and core.hosting.retiring == list(range(2, 8))
        await core.step_exactly(new, 1)
        moved = core.open("moved", 0, 2)
        await core.step_exactly(moved, 4)
        core.sessions.close_all()
        await until(lambda: core.hosting.retiring == [])
        assert sorted(core.params_pages()) == [0, 1]
        stats = core.pool.stats()
        assert stats.pages_kv == 0 and stats.pages_params == 2 * max(core.params_pages().values())
        core.pool.check_invariants()

    run(body)


def test_new_blocks_wait_for_leaving_ones_to_free_their_pages(tiny_llama: Path) -> None:
    async def body() -> None:
        core = Core(tiny_llama, 0, 4, pool_blocks=4.5, kv_pages=8)
        core.scheduler.start()
        session = core.open("a", 0, 4)
        await core.step_exactly(session, 2)
        change = asyncio.create_task(core.hosting.change(2, 6))
        await until(lambda: core.hosting.serving == (2, 4))
        await asyncio.sleep(0.3)
        assert not change.done(), "a block was loaded into pages the running session's blocks still hold"
        await core.step_exactly(session, 1)
        core.sessions.close("a")
        await asyncio.wait_for(change, 10)
        assert core.hosting.serving == (2, 6) and sorted(core.params_pages()) == [2, 3, 4, 5]
        core.pool.check_invariants()

        with pytest.raises(OutOfPages):
            await core.hosting.change(0, 8)  # can never fit
        assert core.hosting.serving == (2, 6)
        with pytest.raises(InvalidBlockRange):
            await core.hosting.change(4, 99)
        core.pool.check_invariants()

    run(body)


def test_a_drop_frees_the_dropped_blocks_pages_at_once_and_a_restore_loads_them_back_exactly(tiny_llama: Path) -> None:
    """KunServe on one server: the dropped blocks' parameter pages are free at once, whatever ran on them; sessions
    that used them are evicted with `BlocksDropped`, the others compute on exactly; a restore reloads the weights
    from the checkpoint, and the restored blocks compute as transformers' layers do."""

    async def body() -> None:
        core = Core(tiny_llama, 0, 8, pool_blocks=8, kv_pages=64)
        core.scheduler.start()
        baseline_free = core.pool.stats().pages_free
        kept, victim, tail = core.open("kept", 0, 4), core.open("victim", 0, 8), core.open("tail", 4, 8)
        for session in (kept, victim, tail):
            await core.step_exactly(session, 5)
        victim_pages = victim.pages_held + tail.pages_held
        block_pages = core.params_pages()[4]

        evicted = await core.hosting.drop(0, 4)
        assert sorted(evicted) == ["tail", "victim"]
        assert core.hosting.serving == (0, 4) and core.hosting.restorable == (0, 8)
        assert sorted(core.params_pages()) == [0, 1, 2, 3]  # no batch computed with them: gone at once
        assert core.pool.stats().pages_free == baseline_free - kept.pages_held + 4 * block_pages
        assert victim_pages > 0 and not core.sessions.uses_block(4)
        for session_id in evicted:
            with pytest.raises(BlocksDropped, match="keeps 0:4"):
                core.sessions.get(session_id)
        await core.step_exactly(kept, 1)  # a session on the kept blocks goes on where it is
        with pytest.raises(BlocksNotHosted):
            core.open("late", 0, 8)
        with pytest.raises(InvalidBlockRange):
            await core.hosting.drop(2, 6)  # a drop keeps part of what is served, nothing more
        assert core.hosting.drops == 1
        core.pool.check_invariants()

        await core.hosting.restore()
        assert core.hosting.serving == (0, 8) and core.hosting.restorable is None and core.hosting.restores == 1
        assert sorted(core.params_pages()) == list(range(8))
        again = core.open("again", 0, 8)
        await core.step_exactly(again, 6)  # the reloaded weights are the checkpoint's
        await core.step_exactly(kept, 1)
        core.sessions.close_all()
        assert core.pool.stats().pages_free == baseline_free
        core.pool.check_invariants()

    run(body)


def test_a_victim_computing_while_its_blocks_drop_returns_its_pages_after_its_batch(tiny_llama: Path) -> None:
    async def body() -> None:
        core = Core(tiny_llama, 0, 8, pool_blocks=8, kv_pages=64)
        core.scheduler.start()
        baseline_free = core.pool.stats().pages_free
        victim = core.open("victim", 0, 8)
        await core.step_exactly(victim, 3)
        result = await core.computing(victim, 60)
        assert await core.hosting.drop(4, 8) == ["victim"]
        assert core.hosting.serving == (4, 8)
        assert sorted(core.params_pages()) == list(range(8))  # the batch still computes with blocks 0-3
        await asyncio.gather(result, return_exceptions=True)  # its step ends either way; the others' would go on
        await until(lambda: sorted(core.params_pages()) == [4, 5, 6, 7])
        assert core.pool.stats().pages_free == baseline_free + 4 * core.params_pages()[4]
        core.pool.check_invariants()

    run(body)


def test_a_full_server_whose_drop_is_freeing_pages_asks_a_refused_client_to_come_back_soon(tiny_llama: Path) -> None:
    async def body() -> None:
        core = Core(tiny_llama, 0, 8, pool_blocks=8, kv_pages=64)
        core.scheduler.start()
        victim = core.open("victim", 0, 8)
        await core.step_exactly(victim, 3)
        result = await core.computing(victim, 60)
        core.pool.allocate(KVOwner("filler", 4), core.pool.stats().pages_free)  # the rest of the pool is taken
        with pytest.raises(ServerBusy) as full:
            core.open("early", 4, 8)
        assert full.value.retry_after_s is None  # nothing is coming back: the client's own backoff
        assert await core.hosting.drop(4, 8) == ["victim"]
        coming = 4 * core.params_pages()[0]
        assert core.hosting.retiring_pages() == coming  # its batch still computes with blocks 0-3
        with pytest.raises(ServerBusy) as soon:
            core.open("late", 4, 8)
        assert soon.value.retry_after_s == SOON_RETRY_MS / 1000
        assert f"{coming} more return as dropped blocks unload" in soon.value.message
        wired = ServerBusy.from_wire(soon.value.to_wire())  # the hint crosses the wire
        assert isinstance(wired, ServerBusy) and wired.retry_after_s == SOON_RETRY_MS / 1000
        await asyncio.gather(result, return_exceptions=True)
        await until(lambda: core.hosting.retiring_pages() == 0)
        core.open("late", 4, 8)  # the pages came back, as the refusal said
        core.pool.free(KVOwner("filler", 4))
        core.sessions.close_all()
        core.pool.check_invariants()

    run(body)


def test_the_leaving_blocks_of_a_range_change_promise_no_room_soon_since_they_wait_for_whole_sessions(
    tiny_llama: Path
) -> None:
    async def body() -> None:
        core = Core(tiny_llama, 0, 8, pool_blocks=8, kv_pages=64)
        core.scheduler.start()
        session = core.open("open", 0, 8)
        await core.step_exactly(session, 3)
        await core.hosting.change(4, 8)
        assert core.hosting.retiring == [0, 1, 2, 3]  # until the session ends, however long it runs
        assert core.hosting.retiring_pages() == 0
        core.sessions.close_all()
        await until(lambda: core.hosting.retiring == [])
        core.pool.check_invariants()

    run(body)


def test_a_refused_client_asks_again_when_the_server_expects_room_and_keeps_its_backoff() -> None:
    backoff_s, waits = BUSY_BACKOFF_FIRST_S, []
    for soon_s in (None, 0.8, SOON_RETRY_MS / 1000, SOON_RETRY_MS / 1000, None, None, None, 0.0, 60.0):
        wait_s, backoff_s = busy_retry_wait(backoff_s, soon_s)
        waits.append(wait_s)
    # doubling from 0.5 s to at most 4 s; a named time sooner than the backoff is kept to (never below MIN_RETRY_S)
    # and does not double the backoff
    assert waits == [0.5, 0.8, 0.25, 0.25, 1.0, 2.0, 4.0, MIN_RETRY_S, BUSY_BACKOFF_MAX_S]
    # a named time later than the backoff: the backoff, doubled after it
    assert busy_retry_wait(0.5, 0.8) == (0.5, 1.0)


def test_a_restore_into_scattered_free_pages_moves_kv_pages_aside_and_the_sessions_compute_on_exactly(
    tiny_llama: Path
) -> None:
    """After a drop, sessions fill every page, and every other one ends: enough pages are free for the dropped
    blocks, but in holes of one session each. The restore moves KV pages out of the way to clear a run for each
    block, and the sessions whose pages moved compute on exactly (their KV came along)."""

    async def body() -> None:
        core = Core(tiny_llama, 0, 8, pool_blocks=8, kv_pages=200)
        core.scheduler.start()
        await core.hosting.drop(0, 4)
        block_pages = core.params_pages()[0]
        sessions = []
        while core.pool.pages_free >= 4:
            sessions.append(core.open(f"s{len(sessions)}", 0, 4))
            await core.step_exactly(sessions[-1], 5)
        for session in sessions[::2]:
            core.sessions.close(session.session_id)
        staying = sessions[1::2]
        assert core.pool.pages_free >= 4 * block_pages > core.pool.largest_free_run()

        await core.hosting.restore()
        assert core.hosting.serving == (0, 8) and sorted(core.params_pages()) == list(range(8))
        for session in staying:
            await core.step_exactly(session, 1)  # its KV, wherever its pages went, is what it computed
        core.pool.check_invariants()

    run(body)
