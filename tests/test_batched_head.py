"""The client's shared LM head: threads' rows compute in one pass, sessions whose steps are on their way are waited
for (boundedly), and the sessions of one pass send their next steps together."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from client import batched_head
from client.batched_head import BatchedHead
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

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    if errors:
        raise errors[0]
    return results


def test_a_lone_caller_computes_at_once(head: BatchedHead) -> None:
    hidden = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    logits = head.logits(hidden)
    assert time.perf_counter() - started < batched_head.MAX_GANG_WAIT_S
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
        return head.logits(rows[index])

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
    started = time.perf_counter()
    head.logits(torch.ones(1, 1, 64))
    assert 0.15 < time.perf_counter() - started < 2.0
    head.step_sent()
    head.step_failed(returned=False)  # a failed step is not waited for at all
    started = time.perf_counter()
    head.logits(torch.ones(1, 1, 64))


def test_a_failing_pass_fails_every_caller_in_it(head: BatchedHead, monkeypatch: pytest.MonkeyPatch) -> None:
    for _ in range(3):
        head.step_sent()

    def broken(hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(head.head, "logits", broken)

    def session(index: int) -> str:
        head.step_returned()
        try:
            head.logits(torch.ones(1, 1, 64))
        except RuntimeError as error:
            return str(error)
        return "no error"

    assert in_threads(3, session) == ["out of memory"] * 3


def test_the_sessions_of_one_pass_send_their_next_steps_together(head: BatchedHead) -> None:
    for _ in range(4):
        head.step_sent()
    sent_at: list[float] = [0.0] * 4

    def session(index: int) -> None:
        head.step_returned()
        head.logits(torch.ones(1, 1, 64))
        time.sleep(0.002 * index)  # each thread has a little work before its next step
        head.step_sent()
        sent_at[index] = time.perf_counter()

    in_threads(4, session)
    assert head.passes == 1
    assert max(sent_at) - min(sent_at) < 0.003  # released together, not 6 ms apart
