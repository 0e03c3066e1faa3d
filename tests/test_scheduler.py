"""The step scheduler: ready steps of many sessions compute in one forward pass, long prefills in chunks beside
decode steps, and a step that cannot run fails alone."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from server import scheduler as scheduler_module
from server.scheduler import StepScheduler
from server.sessions import Session, SessionTable, Step, StepResult
from swarm.errors import InternalServerError, ServerBusy, StepStopped
from swarm.memory import PagePool
from swarm.model import BlockRange, resolve_model
from swarm.model.blocks import ForwardPass
from tests.reference import ReferenceBlocks

HIDDEN = 64


class Engine:
    """A server's hosting core without the network: blocks 0:8 of the tiny Llama, sessions and the scheduler."""

    def __init__(self, model: Path, *, pages: int, max_batch_tokens: int, page_tokens: int = 16,
                 on_steps_done: Callable[[list[Step]], None] = lambda steps: None) -> None:
        self.source = resolve_model(str(model))
        self.blocks = BlockRange(self.source, 0, 8)
        page_bytes = page_tokens * self.blocks.kv_bytes_per_token()
        self.pool = PagePool(pages * page_bytes, page_bytes)
        kv = self.blocks.paged_kv(self.pool.storage, page_bytes)
        self.sessions = SessionTable(block_start=0, block_end=8, pool=self.pool, tokens_per_page=kv.tokens_per_page,
                                     max_length=256, headroom_tokens=0)
        self.scheduler = StepScheduler(self.blocks, kv, self.sessions, max_batch_tokens=max_batch_tokens,
                                       inline_step_ms=0, block_compute_ms=1.0, on_steps_done=on_steps_done)
        self.references: dict[str, ReferenceBlocks] = {}
        self.generator = torch.Generator().manual_seed(0)

    def open(self, name: str) -> Session:
        self.references[name] = ReferenceBlocks(self.source, 0, 8)
        return self.sessions.open(name, 0, 8, batch=1, max_length=256)

    def submit(self, session: Session, tokens: int) -> tuple[asyncio.Future[StepResult], torch.Tensor]:
        """Queues a step of `tokens` random hidden states; gives its future result and the output it must have."""
        hidden = torch.randn(1, tokens, HIDDEN, generator=self.generator)
        result = asyncio.get_running_loop().create_future()
        step = Step(session, f"{session.position}", hidden, result)
        session.running = step
        self.scheduler.submit(step)
        return result, self.references[session.session_id](hidden)


def check(result: asyncio.Future[StepResult], expected: torch.Tensor) -> None:
    torch.testing.assert_close(result.result().output, expected, rtol=1e-5, atol=1e-5)


def scenario(body: Callable[[], object]) -> None:
    async def main() -> None:
        try:
            await body()  # type: ignore[misc]
        finally:
            for task in asyncio.all_tasks():
                if task.get_name() == "step-scheduler":
                    task.cancel()

    asyncio.run(main())


def hold_each_block(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Makes every forward pass wait before each of its blocks until the test sets `release` (the second event);
    the first is set once a pass waits."""
    started, release = threading.Event(), threading.Event()
    advance = ForwardPass.advance

    def held_advance(self: ForwardPass) -> None:
        started.set()
        release.wait(30)
        advance(self)

    monkeypatch.setattr(ForwardPass, "advance", held_advance)
    return started, release


def hold_at_block(monkeypatch: pytest.MonkeyPatch, block: int) -> tuple[threading.Event, threading.Event]:
    """Makes a pass of more than one row wait before its block `block` until the test sets `release` (the second
    event); the first is set once one waits there."""
    started, release = threading.Event(), threading.Event()
    advance = ForwardPass.advance

    def held_advance(self: ForwardPass) -> None:
        if self.next_block == self.first_block + block and self.hidden.shape[0] > 1:
            started.set()
            release.wait(30)
        advance(self)

    monkeypatch.setattr(ForwardPass, "advance", held_advance)
    return started, release


async def until_set(event: threading.Event) -> None:
    """Returns once `event` is set (a batch waits on its thread), within 10 s."""
    for _ in range(1000):
        if event.is_set():
            return
        await asyncio.sleep(0.01)


def test_ready_steps_of_many_sessions_compute_in_one_forward_pass(tiny_llama: Path) -> None:
    async def body() -> None:
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=64)
        engine.scheduler.start()
        sessions = [engine.open(name) for name in "abcd"]
        prompts = [engine.submit(session, tokens) for session, tokens in zip(sessions, (3, 5, 7, 2), strict=True)]
        for result, expected in prompts:
            await result
            check(result, expected)
        assert engine.scheduler.stats.batches == 1  # four prompts of different lengths, one pass
        for _ in range(3):
            decodes = [engine.submit(session, 1) for session in sessions]
            for result, expected in decodes:
                await result
                check(result, expected)
        assert engine.scheduler.stats.batches == 4 and engine.scheduler.stats.sizes[4] == 4
        assert [session.position for session in sessions] == [6, 8, 10, 5]
        await engine.scheduler.stop()

    scenario(body)


def test_a_long_prefill_is_chunked_and_decode_steps_ride_in_every_batch(tiny_llama: Path) -> None:
    async def body() -> None:
        decoding: dict[str, int] = {}
        expected: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
        results: dict[str, list[asyncio.Future[StepResult]]] = {"a": [], "b": []}

        def next_decode(steps: list[Step]) -> None:  # clients whose next token is ready as soon as the last is done
            for step in steps:
                name = step.session.session_id
                if name in decoding and decoding[name] > 0:
                    decoding[name] -= 1
                    result, output = engine.submit(step.session, 1)
                    results[name].append(result)
                    expected[name].append(output)

        engine = Engine(tiny_llama, pages=64, max_batch_tokens=10, on_steps_done=next_decode)
        a, b, long = engine.open("a"), engine.open("b"), engine.open("long")
        engine.scheduler.start()
        for session in (a, b):  # short prompts first
            result, output = engine.submit(session, 4)
            await result
            check(result, output)
        decoding.update(a=12, b=12)
        for session in (a, b):
            decoding[session.session_id] -= 1
            result, output = engine.submit(session, 1)
            results[session.session_id].append(result)
            expected[session.session_id].append(output)
        prefill, prefill_expected = engine.submit(long, 40)  # 40 tokens, at most 10 per batch beside 2 decodes
        await prefill
        check(prefill, prefill_expected)
        stats = engine.scheduler.stats
        assert stats.mixed >= 40 // 8 - 1  # its chunks shared their batches with the decode steps
        assert max(stats.tokens) <= 16  # never more than the budget (10)
        assert stats.prefill_tokens == 4 + 4 + 40  # every prompt token, counted once
        assert 40 // 10 <= stats.prefill_batches <= stats.batches  # the long prompt alone took 4 chunks
        assert 0 < stats.prefill_batch_ms <= stats.compute_ms
        # the computing thread's CPU: some in the prompts' batches, never more than the batches' wall time
        assert 0 < stats.prefill_batch_cpu_ms <= stats.cpu_ms <= stats.compute_ms + 1
        for _ in range(1000):  # the decode chains go on after the prefill; each step queues the next
            if not any(decoding.values()) and all(r.done() for r in (*results["a"], *results["b"])):
                break
            await asyncio.sleep(0.01)
        assert len(results["a"]) == len(results["b"]) == 12
        for name in "ab":
            for result, output in zip(results[name], expected[name], strict=True):
                check(result, output)
        await engine.scheduler.stop()

    scenario(body)


def test_a_session_that_cannot_get_its_next_page_fails_alone(tiny_llama: Path) -> None:
    async def body() -> None:
        engine = Engine(tiny_llama, pages=8 * 3, max_batch_tokens=64, page_tokens=4)
        engine.scheduler.start()
        grows, stays = engine.open("grows"), engine.open("stays")
        for session in (grows, stays):
            result, _ = engine.submit(session, 3)
            await result
        engine.open("third")  # the last 8 pages
        failing, _ = engine.submit(grows, 2)  # 5 tokens need a second page per block: none is free
        passing, expected = engine.submit(stays, 1)
        with pytest.raises(ServerBusy, match="out of KV pages"):
            await failing
        await passing
        check(passing, expected)
        assert grows.position == 3 and grows.running is None  # unchanged, and the client may retry or move it
        engine.sessions.close("third")
        retried, _ = engine.submit(grows, 2)
        await retried
        assert grows.position == 5
        await engine.scheduler.stop()
        engine.sessions.close_all()
        assert engine.pool.stats().pages_kv == 0
        engine.pool.check_invariants()

    scenario(body)


def test_a_step_that_breaks_the_batch_fails_only_its_own_session(tiny_llama: Path) -> None:
    async def body() -> None:
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=64)
        engine.scheduler.start()
        sessions = {name: engine.open(name) for name in "abc"}
        for session in sessions.values():
            result, _ = engine.submit(session, 2)
            await result
        sessions["b"].page_tables[3][0][0] = engine.pool.pages_total + 5  # a page table gone wrong: no such page
        steps = {name: engine.submit(session, 1) for name, session in sessions.items()}
        with pytest.raises(InternalServerError, match="IndexError"):
            await steps["b"][0]
        for name in "ac":
            await steps[name][0]
            check(*steps[name])
        assert sessions["b"].position == 2 and sessions["a"].position == 3
        await engine.scheduler.stop()

    scenario(body)


def test_a_session_closed_while_its_batch_computes_gets_its_pages_back_after_it(tiny_llama: Path) -> None:
    async def body() -> None:
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=512)
        started, release = threading.Event(), threading.Event()
        forward = engine.scheduler._timed_forward

        def held_forward(*args):  # type: ignore[no-untyped-def]  # the batch waits on its thread until released
            started.set()
            release.wait(30)
            return forward(*args)

        engine.scheduler._timed_forward = held_forward  # type: ignore[method-assign]
        engine.scheduler.start()
        closing, staying = engine.open("closing"), engine.open("staying")
        closed_result, _ = engine.submit(closing, 20)
        staying_result, expected = engine.submit(staying, 20)
        await until_set(started)
        assert engine.scheduler.computing
        held = engine.pool.owners()
        engine.sessions.close("closing")
        assert engine.pool.owners() == held  # the thread still writes into its pages
        release.set()
        await staying_result
        check(staying_result, expected)
        await closed_result
        assert not engine.pool.has_session("closing")
        engine.pool.check_invariants()
        await engine.scheduler.stop()

    scenario(body)


def test_a_stopped_prompt_ends_where_its_batch_ends_and_runs_again_exact_from_the_sessions_position(
    tiny_llama: Path
) -> None:
    """A drop's victim: its prompt, computing in chunks, stops where the batch computing it ends (a queued one at
    once, without computing); a prompt that batch completes ends as usual. The session stays where it was, and the
    prompt sent again (over the KV the stopped run wrote past the position) and the steps after it are exact."""
    async def body() -> None:
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=16)
        started, release = threading.Event(), threading.Event()
        forward = engine.scheduler._timed_forward

        def held_forward(*args):  # type: ignore[no-untyped-def]  # the first batch waits on its thread until released
            started.set()
            release.wait(30)
            return forward(*args)

        engine.scheduler._timed_forward = held_forward  # type: ignore[method-assign]
        short, long, queued = engine.open("short"), engine.open("long"), engine.open("queued")
        for session in (short, long, queued):
            session.last_active_s = 0.0  # idle: a prompt's chunk leaves no room for their decode steps
        short_result, short_expected = engine.submit(short, 6)
        long_step, queued_step = torch.randn(1, 40, HIDDEN), torch.randn(1, 20, HIDDEN)
        long_result = asyncio.get_running_loop().create_future()
        long.running = Step(long, "0", long_step, long_result)
        engine.scheduler.submit(long.running)
        queued_result = asyncio.get_running_loop().create_future()
        queued.running = Step(queued, "0", queued_step, queued_result)
        engine.scheduler.submit(queued.running)
        engine.scheduler.start()
        await until_set(started)
        assert engine.scheduler.computing  # short's 6 tokens and long's first 10 (the budget's 16)
        assert all(engine.scheduler.stop_step(session) for session in (short, long, queued))
        release.set()
        await short_result
        check(short_result, short_expected)  # its batch completed it
        for result, done in ((long_result, 10), (queued_result, 0)):
            with pytest.raises(StepStopped, match=f"after {done} of its"):
                await result
        assert long.position == queued.position == 0 and long.running is None and queued.running is None
        assert engine.scheduler.stats.prefill_tokens == 6 + 10  # the queued prompt computed nothing
        assert engine.scheduler.stats.failed["StepStopped"] == 2
        for session, hidden in ((long, long_step), (queued, queued_step)):  # sent again, then a decode step
            again = asyncio.get_running_loop().create_future()
            session.running = Step(session, "0", hidden, again)
            engine.scheduler.submit(session.running)
            await again
            check(again, engine.references[session.session_id](hidden))
            result, expected = engine.submit(session, 1)
            await result
            check(result, expected)
        assert long.position == 41 and queued.position == 21
        await engine.scheduler.stop()
        engine.sessions.close_all()
        engine.pool.check_invariants()

    scenario(body)


def test_a_late_step_joins_only_when_its_catch_up_costs_the_batch_less_than_it_would_wait(tiny_llama: Path) -> None:
    """block_compute_ms 1 ms (a lone row); a pass of 8 blocks. The rule: (steps + 1) x blocks done x 1 ms <= 8 x the
    pass's pace per block so far, except in a compute-bound prefill chunk's batch."""
    import time

    from server.scheduler import _Pass

    async def body() -> None:
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=64)
        session = engine.open("a")
        result = asyncio.get_running_loop().create_future()
        item = (Step(session, "0", torch.zeros(1, 1, HIDDEN), result), 1)

        def joins(steps: int, done: int, pace_ms: float, prefill: bool = False) -> bool:
            running = _Pass(items=[item] * steps, tokens=steps, blocks=8, blocks_done=done, prefill=prefill)
            running.started_s = time.perf_counter() - done * pace_ms / 1000
            return engine.scheduler._worth_joining(running)

        assert joins(7, 0, 1.0)  # nothing passed: nothing to catch up
        assert joins(1, 4, 1.0) and not joins(1, 5, 1.0)  # one step at a decode pace: up to half the blocks
        assert joins(3, 2, 1.0) and not joins(3, 3, 1.0)  # four to hold up: a quarter
        assert joins(1, 7, 5.0) and not joins(7, 7, 5.0)  # a decode batch five times slower per block
        assert joins(7, 7, 5.0, prefill=True)  # a compute-bound chunk: at any block, or wait for the next chunk
        assert not joins(7, 7, 1.2, prefill=True) and joins(1, 4, 1.2, prefill=True)  # a GPU's chunk: as decode
        running = _Pass(items=[item] * 7, tokens=7, blocks=8, blocks_done=7, started_s=time.perf_counter() - 0.007)
        running.joining.append((item[0], 1, torch.zeros(1, HIDDEN), None))  # type: ignore[arg-type]
        assert engine.scheduler._worth_joining(running)  # a catch-up is forming: one more row rides it

    scenario(body)


def test_a_step_that_arrives_while_a_batch_computes_joins_it_between_two_blocks(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        started, release = hold_each_block(monkeypatch)
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=64)
        engine.scheduler.start()
        first, late, too_big = engine.open("first"), engine.open("late"), engine.open("too-big")
        computing, computing_expected = engine.submit(first, 3)
        await until_set(started)
        joining, joining_expected = engine.submit(late, 2)  # fits the budget: joins at the next block boundary
        waiting, waiting_expected = engine.submit(too_big, 70)  # does not: a chunk of it joins, the rest waits
        release.set()
        for result, expected in ((computing, computing_expected), (joining, joining_expected),
                                 (waiting, waiting_expected)):
            await result
            check(result, expected)
        stats = engine.scheduler.stats
        assert stats.joined == 2  # the late step and the first chunk of the big one
        assert stats.batches == 2 and stats.sizes[4] == 1  # 3 + 2 + 59 tokens at once, then the big one's last 11
        await engine.scheduler.stop()

    scenario(body)


def test_a_prompt_that_joins_a_computing_batch_leaves_room_for_the_other_sessions_decode_steps(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget of 10 tokens: a 3-token step computes; a 30-token prompt arrives and joins leaving a token for each
    other active session (the decoding one; its own, as in a batch's forming), not with all 7; the decoding session's
    step then joins too instead of waiting for the next batch."""
    async def body() -> None:
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=10)
        engine.scheduler.start()
        decoding, first, long = engine.open("decoding"), engine.open("first"), engine.open("long")
        result, expected = engine.submit(decoding, 2)  # active: it stepped within the last second
        await result
        check(result, expected)
        started, release = hold_each_block(monkeypatch)
        computing, computing_expected = engine.submit(first, 3)
        await until_set(started)
        prompt, prompt_expected = engine.submit(long, 30)
        step, step_expected = engine.submit(decoding, 1)
        release.set()
        await step
        check(step, step_expected)
        assert not prompt.done()  # the decode step rode the first batch, the prompt's rest computes after it
        for result, expected in ((computing, computing_expected), (prompt, prompt_expected)):
            await result
            check(result, expected)
        stats = engine.scheduler.stats
        assert stats.joined == 2  # the prompt's first 5 tokens and the decode step
        assert stats.to_wire()["decode_step_ms"]["beside_prefill_beyond_its_batch"]["max_ms"] == 0  # type: ignore[index]
        await engine.scheduler.stop()

    scenario(body)


def test_a_prompt_waits_for_a_computing_decode_batch_instead_of_holding_its_rows(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        started, release = hold_each_block(monkeypatch)
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=64)
        engine.scheduler.start()
        decoding, long = engine.open("decoding"), engine.open("long")
        step, step_expected = engine.submit(decoding, 1)
        await until_set(started)
        prompt, prompt_expected = engine.submit(long, 20)  # the budget has room, but the batch computes no chunk
        release.set()
        for result, expected in ((step, step_expected), (prompt, prompt_expected)):
            await result
            check(result, expected)
        stats = engine.scheduler.stats
        assert stats.joined == 0 and stats.batches == 2
        await engine.scheduler.stop()

    scenario(body)


async def prefilled(engine: Engine, *names: str) -> list[Session]:
    """Starts `engine`'s scheduler and opens a session per name, each with a 4-token prompt computed exactly."""
    engine.scheduler.start()
    sessions = [engine.open(name) for name in names]
    for session in sessions:
        await exact(engine.submit(session, 4))
    return sessions


async def exact(*steps: tuple[asyncio.Future[StepResult], torch.Tensor]) -> None:
    """Waits for each step's result, in order, and checks it against the output it must have."""
    for result, expected in steps:
        await result
        check(result, expected)


async def decode_beside_a_held_chunk(engine: Engine, decoding: Session, long: Session, started: threading.Event,
                                    release: threading.Event) -> None:
    """Submits a 30-token prompt of `long`, whose pass waits at a block (`hold_at_block`: its first block is done,
    far slower than a lone row's 1 ms), then a decode step of `decoding` while it waits; releases it and checks both
    steps' outputs."""
    prompt = engine.submit(long, 30)
    await until_set(started)
    await asyncio.sleep(0.02)
    step = engine.submit(decoding, 1)
    release.set()
    await exact(step, prompt)


def test_a_decode_step_passes_a_compute_bound_prompt_chunk_and_comes_back_before_it(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step that arrives while a prompt's chunk computes bound by compute runs through all its blocks at the
    chunk's next block boundary, on its own, and is answered while the chunk goes on; both are exact."""
    async def body() -> None:
        answered: list[str] = []
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=64,
                        on_steps_done=lambda steps: answered.extend(step.session.session_id for step in steps))
        (decoding,) = await prefilled(engine, "decoding")
        long = engine.open("long")
        started, release = hold_at_block(monkeypatch, 1)
        await decode_beside_a_held_chunk(engine, decoding, long, started, release)
        assert answered == ["decoding", "decoding", "long"]  # the decode step came back before the chunk
        stats = engine.scheduler.stats
        assert (stats.passed, stats.joined, stats.batches) == (1, 0, 3)
        wire = stats.to_wire()["decode_step_ms"]
        assert wire["passing_prefill"]["count"] == 1 and wire["beside_prefill"]["count"] == 0  # type: ignore[index]
        assert (decoding.position, long.position) == (5, 30)
        await engine.scheduler.stop()
        engine.sessions.close_all()
        engine.pool.check_invariants()

    scenario(body)


def test_a_decode_step_near_a_chunks_end_rides_it_rather_than_pass_it_for_little_gain(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone row costs 20 ms a block here: a decode step's pass through the 8 blocks would hold the chunk 160 ms.
    Arriving with two blocks of the chunk left (100-300 ms at its pace so far), less than twice that, it joins; with
    seven left, it passes."""
    async def body() -> None:
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=64)
        (decoding,) = await prefilled(engine, "decoding")
        long = engine.open("long")
        for block, passed, joined in ((6, 0, 1), (1, 1, 1)):
            engine.scheduler.block_compute_ms = 20.0
            started, release = hold_at_block(monkeypatch, block)
            prompt = engine.submit(long, 10)
            await until_set(started)
            await asyncio.sleep(0.3)  # 300 ms over `block` blocks: bound by compute at either (> 40 ms a block)
            step = engine.submit(decoding, 1)
            release.set()
            await exact(step, prompt)
            assert (engine.scheduler.stats.passed, engine.scheduler.stats.joined) == (passed, joined)
            monkeypatch.undo()
        await engine.scheduler.stop()

    scenario(body)


def test_a_chunk_is_passed_once_and_later_decode_steps_ride_it(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One session's decode step passes the chunk at its second block; another's, arriving at its fifth, rides it:
    a pass through all the blocks for every lone step would starve the prompt."""
    async def body() -> None:
        engine = Engine(tiny_llama, pages=96, max_batch_tokens=64)
        first, second = await prefilled(engine, "first", "second")
        long = engine.open("long")
        held = {block: (threading.Event(), threading.Event()) for block in (1, 4)}
        advance = ForwardPass.advance

        def held_advance(self: ForwardPass) -> None:
            waits = held.get(self.next_block - self.first_block)
            if waits is not None and self.hidden.shape[0] > 1:
                waits[0].set()
                waits[1].wait(30)
            advance(self)

        monkeypatch.setattr(ForwardPass, "advance", held_advance)
        prompt = engine.submit(long, 30)
        await until_set(held[1][0])
        await asyncio.sleep(0.02)
        passing = engine.submit(first, 1)
        held[1][1].set()
        await until_set(held[4][0])
        await asyncio.sleep(0.02)
        assert passing[0].done()  # answered while the chunk computes
        riding = engine.submit(second, 1)
        held[4][1].set()
        await exact(passing, riding, prompt)
        assert (engine.scheduler.stats.passed, engine.scheduler.stats.joined) == (1, 1)
        await engine.scheduler.stop()

    scenario(body)


def test_decode_steps_whose_pass_fails_go_in_the_next_batch_exact(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the pass of decode steps passing a chunk raises, they lose nothing: they compute in the next batch."""
    async def body() -> None:
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=64)
        (decoding,) = await prefilled(engine, "decoding")
        long = engine.open("long")
        started, release = hold_at_block(monkeypatch, 1)
        construct = ForwardPass.__init__
        failures = []

        def failing_once(self: ForwardPass, blocks, kv, hidden, batch) -> None:  # type: ignore[no-untyped-def]
            if not failures and hidden.shape[0] == 1:  # the decode step's own pass
                failures.append(hidden.shape)
                raise RuntimeError("a pass that breaks")
            construct(self, blocks, kv, hidden, batch)

        monkeypatch.setattr(ForwardPass, "__init__", failing_once)
        await decode_beside_a_held_chunk(engine, decoding, long, started, release)
        assert failures and engine.scheduler.stats.passed == 0
        assert (decoding.position, long.position) == (5, 30)
        await engine.scheduler.stop()
        engine.sessions.close_all()
        engine.pool.check_invariants()

    scenario(body)


def test_sessions_of_mixed_lengths_come_and_go_and_the_pool_holds_its_accounting(tiny_llama: Path) -> None:
    async def body() -> None:
        engine = Engine(tiny_llama, pages=8 * 40, max_batch_tokens=24, page_tokens=8)
        engine.scheduler.start()
        rng = random.Random(5)
        open_sessions: dict[str, Session] = {}
        pending: list[tuple[asyncio.Future[StepResult], torch.Tensor]] = []
        for round_index in range(40):
            if len(open_sessions) < 5 and rng.random() < 0.5:
                name = f"s{round_index}"
                open_sessions[name] = engine.open(name)
            for name, session in list(open_sessions.items()):
                if session.running is not None:
                    continue
                if session.position > 20 and rng.random() < 0.2:
                    engine.sessions.close(name)
                    del open_sessions[name]
                    continue
                pending.append(engine.submit(session, rng.choice([1, 1, 1, 3, 12])))
            await asyncio.sleep(0.005)
            engine.pool.check_invariants()
            for session in open_sessions.values():
                if session.running is None:  # a session holds pages for its length: within one page per block
                    assert session.pages_held == 8 * max(1, -(-session.position // 8)), session
        for result, expected in pending:
            await result
            check(result, expected)
        engine.sessions.close_all()
        await engine.scheduler.stop()
        assert engine.pool.stats().pages_kv == 0
        engine.pool.check_invariants()

    scenario(body)


def test_a_decode_step_that_cannot_join_a_chunks_batch_counts_its_wait_before_the_next(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait that `info` reports as `beside_prefill_beyond_its_batch`: a decode step that arrives while a prompt's
    chunk fills the whole budget waits for the batch after it, beside the next chunk, and that wait is counted."""
    async def body() -> None:
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=10)
        engine.scheduler.start()
        decoding, long = engine.open("decoding"), engine.open("long")
        result, expected = engine.submit(decoding, 4)
        await result
        check(result, expected)
        monkeypatch.setattr("server.scheduler.RECENT_WINDOW_S", 0.0)  # no room kept for decode steps in a chunk
        started, release = hold_each_block(monkeypatch)
        prefill, prefill_expected = engine.submit(long, 30)  # a chunk of all 10 tokens computes first
        await until_set(started)
        step, step_expected = engine.submit(decoding, 1)  # the budget is full: it waits for the next batch
        await asyncio.sleep(0.05)
        release.set()
        for result, expected in ((prefill, prefill_expected), (step, step_expected)):
            await result
            check(result, expected)
        stats = engine.scheduler.stats
        assert stats.joined == 0
        beyond = stats.to_wire()["decode_step_ms"]["beside_prefill_beyond_its_batch"]  # type: ignore[index]
        assert beyond["count"] == 1 and beyond["max_ms"] >= 40  # it waited out the first chunk's batch
        await engine.scheduler.stop()

    scenario(body)


def test_a_batch_far_slower_than_the_servers_usual_is_logged_with_what_it_held(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(scheduler_module, "SLOW_BATCH_MIN_MS", 100.0)
    slow = threading.Event()

    async def body() -> None:
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=64)
        engine.scheduler.hold_ms = lambda batch, block: 40.0 if slow.is_set() else 0.0  # 320 ms over the 8 blocks
        engine.scheduler.start()
        session = engine.open("a")
        for tokens in (4, 1, 1, 1):
            result, expected = engine.submit(session, tokens)
            await result
            check(result, expected)
        assert "a batch took" not in caplog.text
        slow.set()
        result, expected = engine.submit(session, 1)
        await result
        check(result, expected)  # slow, and still exact
        await engine.scheduler.stop()

    with caplog.at_level("WARNING", logger="server.scheduler"):
        scenario(body)
    assert "a batch took" in caplog.text and "1 step(s) (0 joined), 1 token(s) over 8 block(s)" in caplog.text
