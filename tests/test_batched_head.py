"""The client's shared LM head: threads' rows compute in one pass, sessions whose steps are on their way are waited
for (boundedly), and the sessions of one pass send their next steps together."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from client import batched_head
from client.batched_head import BatchedHead, SendGate
from swarm.model import ClientHead, resolve_model


@pytest.fixture
def head(tiny_llama: Path) -> BatchedHead:
    return BatchedHead(ClientHead(resolve_model(str(tiny_llama))))


def in_threads(count: int, work) -> list[object]:  # type: ignore[no-untyped-def]
    results: list[object] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = work(index)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    if errors:
        raise errors[0]
    return results


def test_a_lone_caller_computes_at_once(head: BatchedHead, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched_head, "MAX_GANG_WAIT_S", 600.0)  # a wait would hold the call past the join below
    hidden = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0))
    logits = in_threads(1, lambda _: head.logits(hidden))[0]
    assert isinstance(logits, torch.Tensor), "a lone caller waited for sessions that do not exist"
    torch.testing.assert_close(logits, head.head.logits(hidden), rtol=1e-5, atol=1e-5)
    assert logits.shape == (1, 3, 128) and head.passes == 1


def test_rows_of_sessions_on_their_way_compute_in_one_pass(head: BatchedHead) -> None:
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randn(1, 1, 64, generator=generator) for _ in range(6)]
    for _ in rows:
        head.step_sent()  # six sessions' decode steps are in the swarm

    def session(index: int) -> torch.Tensor:
        time.sleep(0.01 * index)  # their outputs come back one after another
        head.step_returned()
        return head.logits(rows[index], sent=True)

    results = in_threads(6, session)
    assert head.passes == 1 and head.rows == 6
    for hidden, logits in zip(rows, results, strict=True):
        torch.testing.assert_close(logits, head.head.logits(hidden), rtol=1e-5, atol=1e-5)


def test_a_step_that_never_comes_back_is_waited_for_only_so_long(
    head: BatchedHead, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batched_head, "MAX_GANG_WAIT_S", 0.2)
    head.step_sent()  # a session whose step is lost: it never returns, nor fails
    head.step_sent()
    head.step_returned()
    started = time.monotonic()
    head.logits(torch.ones(1, 1, 64), sent=True)
    assert time.monotonic() - started >= 0.2  # it waited for the lost step until the deadline, then went on


def test_a_failed_step_is_not_waited_for(head: BatchedHead, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched_head, "MAX_GANG_WAIT_S", 600.0)  # a wait would hold the call past the join below
    head.step_sent()
    head.step_sent()
    head.step_returned()
    head.step_failed(returned=False)
    assert isinstance(in_threads(1, lambda _: head.logits(torch.ones(1, 1, 64), sent=True))[0], torch.Tensor)


def test_a_failing_pass_fails_every_caller_in_it(head: BatchedHead, monkeypatch: pytest.MonkeyPatch) -> None:
    for _ in range(3):
        head.step_sent()

    def broken(hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(head.head, "logits", broken)

    def session(index: int) -> str:
        head.step_returned()
        try:
            head.logits(torch.ones(1, 1, 64), sent=True)
        except RuntimeError as error:
            return str(error)
        return "no error"

    assert in_threads(3, session) == ["out of memory"] * 3


def test_a_pass_waits_only_for_the_steps_of_its_own_chain(head: BatchedHead, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched_head, "MAX_GANG_WAIT_S", 600.0)  # a wait would hold the call past the join below
    head.step_sent("slow chain")  # a session on another chain: its step is still in the swarm
    head.step_sent("fast chain")
    head.step_sent("fast chain")

    def session(index: int) -> torch.Tensor:
        time.sleep(0.01 * index)
        head.step_returned("fast chain")
        return head.logits(torch.full((1, 1, 64), float(index)), "fast chain", sent=True)

    results = in_threads(2, session)
    assert all(isinstance(logits, torch.Tensor) for logits in results), "the fast chain waited for the slow one"
    assert head.passes == 1 and head.rows == 2  # the fast chain's two sessions still went in one pass
    head.step_returned("slow chain")
    assert isinstance(in_threads(1, lambda _: head.logits(torch.ones(1, 1, 64), "slow chain", sent=True))[0],
                      torch.Tensor)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop on a thread of its own, as the client's."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def test_the_sessions_of_one_pass_send_their_next_steps_together(
    head: BatchedHead, loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batched_head, "MAX_SEND_WAIT_S", 600.0)  # however slowly this machine runs the threads
    assert head.step_sent() is None  # no pass yet: a lone session's step leaves at once
    head.step_returned()
    head.logits(torch.ones(1, 1, 64), sent=True)
    for _ in range(4):
        head.step_sent()
    events: list[str] = []

    async def send(gate: SendGate) -> None:
        await gate.wait()
        events.append("sent")  # on the loop, where the client writes the step

    def session(index: int) -> None:
        head.step_returned()
        head.logits(torch.ones(1, 1, 64), sent=True)
        time.sleep(0.002 * index)  # each thread has a little work before its next step
        events.append("ready")
        gate = head.step_sent()
        assert gate is not None
        asyncio.run_coroutine_threadsafe(send(gate), loop).result(timeout=30)

    in_threads(4, session)
    assert head.passes == 2
    assert events == ["ready"] * 4 + ["sent"] * 4  # nobody sent before all four were ready


def test_a_gate_does_not_wait_for_a_session_that_stopped(
    head: BatchedHead, loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batched_head, "MAX_SEND_WAIT_S", 0.05)
    for _ in range(3):
        head.step_sent()

    def session(index: int) -> bool:
        head.step_returned()
        head.logits(torch.ones(1, 1, 64), sent=True)
        if index == 2:
            return True  # its generation ended: it sends nothing more
        gate = head.step_sent()
        assert gate is not None
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(timeout=30)
        return True

    assert in_threads(3, session) == [True] * 3  # the two others went on after the bounded wait
