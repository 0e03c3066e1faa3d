"""The step scheduler: every ready step of every session computes in one forward pass through the server's blocks.

As vLLM's scheduler does, each batch is formed when the previous one ends, under one token budget
(`--max-batch-tokens`): first every waiting decode step (one token per row), then chunks of prefills in arrival
order. A long prompt thus prefills chunk by chunk while the other sessions' decode steps ride along in every batch.
A step that arrives on an idle server starts at once: there is no batching window. Before a chunk computes, its
session takes the pages it will write; a session that cannot get them fails alone (`ServerBusy`). A batch that
raises is computed again step by step, so one bad step fails only its own session.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from server.sessions import Session, SessionTable, StepResult
from swarm.errors import InternalServerError, ServerDraining, SessionNotFound, SwarmError
from swarm.model import BlockRange
from swarm.model.paged_kv import PagedBatch, PagedKV, SequenceChunk
from swarm.records import NextHop

log = logging.getLogger(__name__)

RECENT_WINDOW_S = 1.0  # open sessions that stepped this recently count as active


@dataclass
class Step:
    """A step admitted for computing: one session's new tokens, how far they got, and who awaits the result."""

    session: Session
    step_id: str | None
    hidden: torch.Tensor  # [batch rows, tokens, hidden], in the blocks' dtype
    result: asyncio.Future[StepResult]
    next_hops: list[NextHop] = field(default_factory=list)
    compression: str | None = None
    done: int = 0  # tokens per row computed so far
    outputs: list[torch.Tensor] = field(default_factory=list)
    compute_ms: float = 0.0

    @property
    def tokens(self) -> int:
        return self.hidden.shape[1]

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def remaining(self) -> int:
        return self.tokens - self.done


@dataclass
class BatchStats:
    """What the scheduler has computed: batches by size (steps) and by tokens, and where they ran."""

    batches: int = 0
    mixed: int = 0  # batches where a prefill chunk and decode steps computed together
    steps_by_place: Counter[str] = field(default_factory=Counter)  # "loop" or "pool": steps computed there
    sizes: Counter[int] = field(default_factory=Counter)  # power-of-two bucket of steps per batch -> batches
    tokens: Counter[int] = field(default_factory=Counter)  # power-of-two bucket of tokens per batch -> batches
    failed: Counter[str] = field(default_factory=Counter)  # error code -> steps that failed with it

    def note(self, steps: int, tokens: int, *, mixed: bool, place: str) -> None:
        self.batches += 1
        self.mixed += mixed
        self.steps_by_place[place] += steps
        self.sizes[_bucket(steps)] += 1
        self.tokens[_bucket(tokens)] += 1

    def to_wire(self) -> dict[str, object]:
        """Gives the histograms as `{"<= bound": batches}` maps, bounds in ascending order."""
        return {
            "batches": self.batches,
            "mixed": self.mixed,
            "steps_per_batch": {f"<={bound}": count for bound, count in sorted(self.sizes.items())},
            "tokens_per_batch": {f"<={bound}": count for bound, count in sorted(self.tokens.items())},
            "steps_failed": dict(self.failed),
        }


def _bucket(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


class StepScheduler:
    """Owns the queue of admitted steps and the task that computes them in batches, one batch at a time."""

    def __init__(
        self,
        blocks: BlockRange,
        kv: PagedKV,
        sessions: SessionTable,
        *,
        max_batch_tokens: int,
        inline_step_ms: float,
        block_compute_ms: float,
        on_step_done: Callable[[Step], None],
    ) -> None:
        """`on_step_done(step)` runs once a step is committed, before its result is set (the server pushes it on)."""
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be positive, got {max_batch_tokens}")
        self.blocks, self.kv, self.sessions = blocks, kv, sessions
        self.max_batch_tokens = max_batch_tokens
        self.inline_step_ms = inline_step_ms
        self.block_compute_ms = block_compute_ms  # one token through one block; refined by lone decode steps
        self.on_step_done = on_step_done
        self.stats = BatchStats()
        self.computing = False
        self._queue: list[Step] = []
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="step-scheduler")

    @property
    def pending(self) -> int:
        """Gives the steps queued or computing."""
        return len(self._queue)

    def submit(self, step: Step) -> None:
        """Queues `step`; it joins the next batch that has room for it."""
        self._queue.append(step)
        self._idle.clear()
        self._ready.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Gives whether every queued step finished within `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Stops computing; steps still queued fail with ServerDraining."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for step in self._queue:
            self._fail(step, ServerDraining("the server shut down before computing this step"))
        self._queue.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                batch = self._next_batch()
                if batch:
                    await self._compute(batch)
            self._idle.set()

    def _next_batch(self) -> list[tuple[Step, int]]:
        """Gives the steps of the next batch and how many tokens of each compute in it: decode steps first, then
        prefill chunks, within the token budget; steps that cannot run leave the queue with their typed error."""
        budget = self.max_batch_tokens
        batch: list[tuple[Step, int]] = []
        ordered = [step for step in self._queue if step.tokens == 1] + [step for step in self._queue if step.tokens > 1]
        for step in ordered:
            if step.session.closed:
                self._drop(step, SessionNotFound(f"session {step.session.session_id!r} closed before its step ran"))
                continue
            take = min(step.remaining, budget // step.rows)
            if take < 1:
                if batch:
                    continue
                take = 1  # a step wider than the budget still goes through, one token per row
            try:
                self.sessions.grow(step.session, step.session.position + step.done + take)
            except SwarmError as error:
                self._drop(step, error)
                continue
            batch.append((step, take))
            budget -= take * step.rows
            if budget <= 0:
                break
        return batch

    async def _compute(self, batch: list[tuple[Step, int]]) -> None:
        """Computes one batch, hands each step its chunk's output and finishes the steps that are complete."""
        sessions = [step.session for step, _ in batch]
        for session in sessions:
            self.sessions.enter_batch(session)
        self.computing = True
        inline = self._computes_inline(batch)
        try:
            outputs, compute_ms = await self._forward_isolated(batch, inline)
        finally:
            self.computing = False
            for session in sessions:
                self.sessions.leave_batch(session)
        decode = any(step.tokens == 1 for step, _ in batch)
        prefill = any(step.tokens > 1 for step, _ in batch)
        self.stats.note(len(batch), sum(take * step.rows for step, take in batch), mixed=decode and prefill,
                        place="loop" if inline else "pool")
        if len(batch) == 1 and batch[0][0].rows * batch[0][1] == 1 and compute_ms > 0:
            sample_ms = compute_ms / batch[0][0].session.blocks  # a lone decode step refines the start-up figure
            self.block_compute_ms = 0.9 * self.block_compute_ms + 0.1 * sample_ms
        for (step, take), output in zip(batch, outputs, strict=True):
            if isinstance(output, SwarmError):
                self._drop(step, output)
                continue
            step.outputs.append(output.view(step.rows, take, -1))
            step.done += take
            step.compute_ms += compute_ms
            if step.remaining == 0:
                self._queue.remove(step)
                self._finish(step)

    async def _forward_isolated(
        self, batch: list[tuple[Step, int]], inline: bool
    ) -> tuple[list[torch.Tensor | SwarmError], float]:
        """Gives each step's output rows for its chunk (or its error) and the batch's compute time in ms. A batch
        that fails is computed again one step at a time, so that only the steps that fail alone fail."""
        try:
            output, compute_ms = await self._forward(batch, inline)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if len(batch) == 1:
                return [_typed(error, batch[0][0])], 0.0
            log.warning("a batch of %d steps failed (%s: %s); computing them one by one", len(batch),
                        type(error).__name__, error)
            results: list[torch.Tensor | SwarmError] = []
            total_ms = 0.0
            for item in batch:
                alone, alone_ms = await self._forward_isolated([item], inline=False)
                results.extend(alone)
                total_ms += alone_ms
            return results, total_ms
        sizes = [take * step.rows for step, take in batch]
        return list(output.split(sizes)), compute_ms

    async def _forward(self, batch: list[tuple[Step, int]], inline: bool) -> tuple[torch.Tensor, float]:
        chunks: list[SequenceChunk] = []
        parts = []
        row = 0
        for step, take in batch:
            chunks += step.session.chunks(row, step.done, take)
            parts.append(step.hidden[:, step.done : step.done + take].reshape(-1, step.hidden.shape[-1]))
            row += take * step.rows
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        paged = PagedBatch(tuple(chunks))
        if inline:
            return self._timed_forward(hidden, paged)
        future: Future[tuple[torch.Tensor, float]] = self._executor.submit(self._timed_forward, hidden, paged)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.result()  # the thread still writes into the batch's pages: they stay held until it is done
            raise

    def _timed_forward(self, hidden: torch.Tensor, batch: PagedBatch) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        output = self.blocks(hidden, batch, self.kv)
        if output.device.type == "cuda":
            torch.cuda.synchronize(output.device)
        return output, (time.perf_counter() - started) * 1000

    def _computes_inline(self, batch: list[tuple[Step, int]]) -> bool:
        """Gives whether a batch computes on the event loop itself: one short step (a lone session's decode step)
        while no other session is active. That saves the compute thread's two hand-offs, each a wake-up of a
        sleeping thread, which on a machine whose idle cores sleep deeply cost more than a network leg. With other
        sessions active, batches compute on the thread so that the loop keeps reading their steps meanwhile."""
        if len(batch) != 1:
            return False
        step, take = batch[0]
        now = time.monotonic()
        if any(session is not step.session and now - session.last_active_s < RECENT_WINDOW_S
               for session in self.sessions):
            return False
        expected_ms = step.rows * take * step.session.blocks * self.block_compute_ms
        return expected_ms <= self.inline_step_ms

    def _finish(self, step: Step) -> None:
        """Commits a complete step to its session, lets the server push it on and resolves its result."""
        session = step.session
        output = step.outputs[0] if len(step.outputs) == 1 else torch.cat(step.outputs, dim=1)
        session.position += step.tokens
        session.last_step_id, session.last_result = step.step_id, StepResult(output, step.compute_ms)
        session.last_active_s = time.monotonic()
        session.running = None
        try:
            self.on_step_done(step)
        except Exception:  # a failing push must not keep the step's reply from the client
            log.exception("after-step hook failed for session %s", session.session_id)
        finally:
            step.result.set_result(session.last_result)

    def _drop(self, step: Step, error: SwarmError) -> None:
        if step in self._queue:
            self._queue.remove(step)
        self._fail(step, error)

    def _fail(self, step: Step, error: SwarmError) -> None:
        self.stats.failed[error.code] += 1
        if step.session.running is step:
            step.session.running = None
        if not step.result.done():
            step.result.set_exception(error)
            step.result.exception()  # retrieved here, so that a step nobody awaits (a push) logs no warning


def _typed(error: Exception, step: Step) -> SwarmError:
    if isinstance(error, SwarmError):
        return error
    log.error("step of session %s failed: %s: %s", step.session.session_id, type(error).__name__, error,
              exc_info=error)
    return InternalServerError(f"{type(error).__name__}: {error}")
