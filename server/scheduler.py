"""The step scheduler: every ready step of every session computes in one forward pass through the server's blocks.

As vLLM's scheduler does, each batch is formed when the previous one ends, under one token budget
(`--max-batch-tokens`): first every waiting decode step (one token per row), then chunks of prefills in arrival
order. A long prompt thus prefills chunk by chunk while the other sessions' decode steps ride along in every batch.
A step that arrives on an idle server starts at once: there is no batching window. A step that arrives while a
batch computes joins it at the next block boundary, after catching up through the blocks the batch has passed
(`ForwardPass.join`), when that catch-up costs the batch's steps less than the step would wait
(`StepScheduler._worth_joining`); otherwise it waits for the next batch. A decode step that arrives while a prompt's
chunk computes bound by compute (a CPU's) passes it instead: at the next block boundary the compute thread runs the
decode steps that came through all their blocks on their own and hands them back at once, then goes on with the
chunk (`StepScheduler._passes`). A prompt's chunk joins only a batch that computes a chunk already, and leaves room in
it for the other sessions' decode steps. Before a chunk computes, its
session takes the pages it will write; a session that cannot get them fails alone (`ServerBusy`). A batch that raises
is computed again step by step, so one bad step fails only its own session.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from server.batch_stats import BatchStats
from server.batch_trace import batch_record
from server.sessions import Session, SessionTable, Step, StepResult
from swarm.errors import InternalServerError, ServerDraining, SessionNotFound, StepStopped, SwarmError
from swarm.model import BlockRange
from swarm.model.blocks import ForwardPass
from swarm.model.paged_kv import PagedBatch, PagedKV, SequenceChunk

log = logging.getLogger(__name__)

# Tokens per batch by device: on this project's 2-core CPU a prefill chunk reaches its best cost per token at 128
# tokens through SmolLM2's blocks (0.99 ms/token, as at 256 and 512; 1.14 at 64), so larger chunks only delay the
# decode steps beside them. GPUs need far more tokens to fill; 2048 is vLLM's default for chunked prefill.
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 128, "cuda": 2048}
COMPUTE_BOUND_PACE = 2.0  # a pass this many times slower per block than a lone row is bound by compute
# A decode step passes a compute-bound chunk only if the rest of the chunk would hold it at least this many times what
# its own pass holds the chunk up (`StepScheduler._passes`)
PASS_GAIN = 2.0
MAX_ADMIT_PASSES = 8  # event loop passes that may hand over already-received steps before a batch forms
RECENT_WINDOW_S = 1.0  # open sessions that stepped this recently count as active
SLOW_BATCH_FACTOR = 10.0  # a batch this many times slower per token and block than the server's usual is logged
SLOW_BATCH_MIN_MS = 1000.0  # if it took at least this long


@dataclass
class _Pass:
    """The batch on the compute thread now, and the steps that join it between two blocks.

    The event loop appends to `joining`; the compute thread takes them in at the next block boundary, appends them
    to `items` and, once the pass is done, sets `closed` (all under `lock`), after which nothing joins."""

    items: list[tuple[Step, int]]
    tokens: int
    prefill: bool = False  # whether it computes a prefill chunk
    blocks: int = 0
    blocks_done: int = 0  # written by the compute thread, read by the loop
    started_s: float = 0.0  # when the compute thread started it (perf_counter), set before any block is done
    ended_s: float = 0.0  # and when it ended there
    cpu_ms: float = 0.0  # the CPU time the computing thread spent on it (its own, whatever else runs on the machine)
    closed: bool = False
    joining: list[tuple[Step, int, torch.Tensor, PagedBatch]] = field(default_factory=list)
    passing: list[tuple[Step, int, torch.Tensor, PagedBatch]] = field(default_factory=list)  # decode steps to run
    # ahead of it, on their own, at the next block boundary
    passes: int = 0  # passes of decode steps that went ahead of it so far
    passed_ms: float = 0.0  # the wall time of the passing steps' passes, which is not this batch's
    passed_cpu_ms: float = 0.0  # and their CPU time
    lock: threading.Lock = field(default_factory=threading.Lock)


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
        on_steps_done: Callable[[list[Step]], None],
        hold_ms: Callable[[PagedBatch, int], float] | None = None,
        remote_forward: Callable[[Step], Awaitable[torch.Tensor]] | None = None,
        trace: Callable[[dict[str, object]], None] | None = None,
    ) -> None:
        """`on_steps_done(steps)` runs once the steps a batch completed are committed, before their results are set
        (the server pushes them on, those bound for one next server together). `hold_ms(batch, block)`, if given, is
        how long a batch must take through one block: an emulated GPU server's profile (`server.emulated_gpu`); after
        each block the compute thread waits out what the real computation left of the blocks done so far.
        `remote_forward(step)` computes a step of a session whose KV is partly on a peer (`Session.remote`, KunServe's
        live exchange: `server.remote_attention`); such steps compute on their own, outside batches. `trace(record)`,
        if given, takes a record of every batch computed (`batch_record`; `server.batch_trace`)."""
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be positive, got {max_batch_tokens}")
        self.blocks, self.kv, self.sessions = blocks, kv, sessions
        self.max_batch_tokens = max_batch_tokens
        self.inline_step_ms = inline_step_ms
        self.block_compute_ms = block_compute_ms  # one token through one block; refined by lone decode steps
        self.on_steps_done = on_steps_done
        self.hold_ms = hold_ms
        self.remote_forward = remote_forward
        self.trace = trace
        self._remote: set[asyncio.Task[None]] = set()  # steps computing with a peer's attention
        self.stats = BatchStats()
        # called with (tokens, admitted_s) for every step answered (the server's Prometheus histogram)
        self.step_observers: list[Callable[[int, float], None]] = []
        self.computing = False
        self._usual_ms: float | None = None  # compute per token and block, a running mean over the batches
        self._queue: list[Step] = []
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pass: _Pass | None = None  # the batch on the compute thread now, which steps may join

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="step-scheduler")

    @property
    def pending(self) -> int:
        """Gives the steps queued or computing."""
        return len(self._queue) + len(self._remote)

    def submit(self, step: Step) -> None:
        """Queues `step`: it joins the batch computing now, between two of its blocks, if that batch has room and
        has not gone far, and otherwise the next batch that has room for it. A step of a session whose KV is partly
        on a peer computes at once, on its own."""
        if step.session.remote is not None and self.remote_forward is not None:
            task = asyncio.create_task(self._compute_remote(step), name="remote-step")
            self._remote.add(task)
            task.add_done_callback(self._remote.discard)
            return
        self._queue.append(step)
        self._idle.clear()
        if self._pass is not None:
            self._join(self._pass, step)
        self._ready.set()

    def stop_step(self, session: Session) -> bool:
        """Stops `session`'s running step of several tokens (a prompt) where the tokens computed so far end: at once
        if no batch computes it now, else when that batch ends (a step that batch completes ends as usual). Its
        waiter gets StepStopped; the session stays at the step's start, and the step's next run writes again the KV
        this one wrote past it. Gives whether a step is stopping. A drop's victim goes on through the servers that
        keep its blocks without waiting for the rest of its prompt here, which kept the dropped blocks' pages from new
        sessions (r39: 1.7 s for a 256-token prompt)."""
        step = session.running
        if step is None or step.tokens == 1 or step.result.done():
            return False
        step.stopping = True
        self._ready.set()  # a queued step leaves at the next batch's forming
        return True

    def _stopped(self, step: Step) -> None:
        self._drop(step, StepStopped(
            f"step {step.step_id!r} of session {step.session.session_id!r} stopped after {step.done} of its "
            f"{step.tokens} tokens: the session's blocks are moving"
        ))

    def _join(self, running: _Pass, step: Step) -> None:
        """Hands `step` (or a chunk of it) to the batch computing now, if it fits its budget and progress.

        A prompt's chunk joins only a batch that computes a chunk already: in a decode batch it would hold every
        decode row until the chunk is done (on this CPU about 250 ms for 128 tokens through 15 blocks, against a
        decode batch's 60-80 ms), where waiting costs the prompt at most that decode batch. And it leaves a token of
        the budget for every active session not in the batch, as in `_next_batch` (`_room`): a prompt that took the
        rows kept for them left their decode steps (7-12 in such a batch in a replay of r42's static pipeline) to
        wait for the batch's end and then ride the next chunk's batch, 1.5 batches in all."""
        if step.session.closed or step.stopping:
            return
        if step.tokens == 1 and self._passes(running, step):
            self._hand_over(running, step, 1, passing=True)
            return
        if not self._worth_joining(running):
            return
        left = self.max_batch_tokens - running.tokens
        if step.tokens > 1:
            if not running.prefill:
                return
            with running.lock:
                in_pass = [*running.items, *((joined, take) for joined, take, _, _ in running.joining)]
            left = self._room(step, left, in_pass)
        take = min(step.remaining, left // step.rows)
        if take >= 1:
            self._hand_over(running, step, take, passing=False)

    def _hand_over(self, running: _Pass, step: Step, take: int, *, passing: bool) -> None:
        """Gives `take` tokens of `step` to the compute thread, to join `running` or (`passing`) to pass it at its
        next block boundary, unless `running` has just ended: then the step waits in the queue for the next batch."""
        try:
            self.sessions.grow(step.session, step.session.position + step.done + take)
        except SwarmError as error:
            self._drop(step, error)
            return
        hidden, paged = self._assemble([(step, take)])
        with running.lock:
            if running.closed:
                return
            if passing:
                running.passing.append((step, take, hidden, paged))
            else:
                running.joining.append((step, take, hidden, paged))
                running.tokens += take * step.rows
        self.sessions.enter_batch(step.session)

    def _passes(self, running: _Pass, step: Step) -> bool:
        """Gives whether decode step `step` passes `running` rather than join it: when it computes a prompt's chunk
        bound by compute (at least COMPUTE_BOUND_PACE x a lone row's time per block so far) and the rest of the chunk,
        at its pace so far, would hold the step at least PASS_GAIN x its own pass (a lone row's time through its
        blocks). Joining, the step would wait for the rest of the chunk: on this CPU a chunk's 128 tokens take 110-130
        ms through 15 blocks, where a decode step without one took 45-60 ms (r74-r78: 27-38% of the decode steps on a
        pipelined pair rode a chunk). Passing, it waits for one block of the chunk, and the chunk, with whatever
        waits behind it, waits for its pass, which also spends compute that riding along hardly did: near a chunk's
        end it passes for little gain. A chunk is passed once: the decode steps that reach it until that pass starts
        go in it, later ones ride the chunk. Passing each as it came, a whole server's chunk in r79's calibration was
        passed by up to six lone sessions' steps, each pass a decode step's compute through all 30 blocks. Before the
        chunk's first block is done its pace is unknown, and a step joins it at no catch-up. A GPU's chunk costs about
        a decode step: there steps join it, as a decode batch."""
        done = running.blocks_done
        if not running.prefill or done == 0 or running.passes:
            return False
        pace_ms = ((time.perf_counter() - running.started_s) * 1000 - running.passed_ms) / done
        if pace_ms < COMPUTE_BOUND_PACE * self.block_compute_ms:
            return False
        return (running.blocks - done) * pace_ms >= PASS_GAIN * step.session.blocks * self.block_compute_ms

    def _worth_joining(self, running: _Pass) -> bool:
        """Gives whether a step should join the batch computing now rather than wait for the next one.

        Joining makes the batch's steps wait while the new one catches up through the k blocks passed, each at a
        lone row's time (`block_compute_ms`: decode reads a block's parameters whatever the rows, so one row costs
        about what a batch does); waiting makes the step ride the next pass. It joins when that catch-up, summed
        over the batch's steps and itself, (steps + 1) x k x block_compute_ms, is at most the next pass, taken at
        this pass's pace so far; and always when other steps already wait to catch up at the next block boundary,
        since they catch up in one pass, which one more row hardly lengthens. A decode batch thus takes a late step
        while few steps wait on it and it has far to go ((steps + 1) x k <= blocks where a row costs what the batch
        does: k <= blocks / 2 for one step). A prefill chunk's batch that is compute-bound (at least
        COMPUTE_BOUND_PACE x a lone row's time per block: a CPU) takes decode steps at any block: the next batch
        holds the prompt's next chunk, so a step that waited could lose two chunks' time, against a catch-up that is
        small next to one chunk. A GPU's chunk costs about a decode step (its compute hides under the parameters'
        traffic): its batch takes steps as a decode batch does."""
        done = running.blocks_done
        with running.lock:
            steps, cohort = len(running.items), bool(running.joining)
        if done == 0 or cohort:  # nothing to catch up yet, or one more row of a catch-up already due
            return True
        pace_ms = (time.perf_counter() - running.started_s) * 1000 / done
        if running.prefill and pace_ms >= COMPUTE_BOUND_PACE * self.block_compute_ms:
            return True
        return (steps + 1) * done * self.block_compute_ms <= running.blocks * pace_ms

    async def _compute_remote(self, step: Step) -> None:
        """Computes a step whose attention runs partly on a peer, then commits and finishes it as a batch's."""
        assert self.remote_forward is not None
        started = time.perf_counter()
        self.sessions.enter_batch(step.session)  # its pages stay its own until the step ends, even if it closes
        try:
            output = await self.remote_forward(step)
        except asyncio.CancelledError:
            self._fail(step, ServerDraining("the server shut down before computing this step"))
            raise
        except Exception as error:
            self._fail(step, _typed(error, step))
            return
        finally:
            self.sessions.leave_batch(step.session)
        step.compute_ms = (time.perf_counter() - started) * 1000
        step.outputs.append(output.view(step.rows, step.tokens, -1))
        step.done = step.tokens
        self.stats.note(1, step.rows * step.tokens, compute_ms=step.compute_ms, mixed=False, place="remote")
        if self.trace is not None:
            self.trace(batch_record([(step, step.tokens)], (started, time.perf_counter()), step.compute_ms, 0.0,
                                    joined=0, place="remote", passed=False))
        self._commit(step)
        self._finish([step])

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
        for task in list(self._remote):
            task.cancel()
        await asyncio.gather(*self._remote, return_exceptions=True)
        for step in self._queue:
            self._fail(step, ServerDraining("the server shut down before computing this step"))
        self._queue.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                await self._admit_what_arrived()
                batch = self._next_batch()
                if batch:
                    await self._compute(batch)
            self._idle.set()

    async def _admit_what_arrived(self) -> None:
        """Lets the event loop hand over the steps whose frames this process has already received (several pushes
        read at once, say), so that they join the coming batch instead of waiting for the next one. This waits for
        no network: each pass runs only callbacks that are ready now."""
        for _ in range(MAX_ADMIT_PASSES):
            queued = len(self._queue)
            await asyncio.sleep(0)
            if len(self._queue) == queued:
                return

    def _next_batch(self) -> list[tuple[Step, int]]:
        """Gives the steps of the next batch and how many tokens of each compute in it: decode steps first, then
        prefill chunks, within the token budget; steps that cannot run leave the queue with their typed error.

        A prefill chunk leaves room in the budget for the decode steps of the other active sessions, which may
        arrive while it computes and join it."""
        budget = self.max_batch_tokens
        batch: list[tuple[Step, int]] = []
        decodes = [step for step in self._queue if step.tokens == 1]
        prefills = [step for step in self._queue if step.tokens > 1]
        for step in decodes + prefills:
            if step.session.closed:
                closed = SessionNotFound(f"session {step.session.session_id!r} closed before its step ran")
                self._drop(step, step.session.evicted or closed)
                continue
            if step.stopping:
                self._stopped(step)
                continue
            take = min(step.remaining, self._room(step, budget, batch) // step.rows)
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

    def _room(self, step: Step, left: int, batch: list[tuple[Step, int]]) -> int:
        """Gives the tokens of the budget's `left` that `step` may take in a batch holding `batch`: a decode step all
        of them, a prompt's chunk all but a token for every active session not in the batch, whose decode step may
        arrive while it computes and join it (its own session counted too, as the simulator's `_reserved_batch`)."""
        if step.tokens == 1:
            return left
        return left - self._expected_decode_rows(batch)

    def _expected_decode_rows(self, batch: list[tuple[Step, int]]) -> int:
        """Gives the rows of the other active sessions, whose decode steps may arrive while a batch computes."""
        now = time.monotonic()
        in_batch = {id(step.session) for step, _ in batch}
        return sum(session.batch for session in self.sessions
                   if id(session) not in in_batch and now - session.last_active_s < RECENT_WINDOW_S)

    async def _compute(self, batch: list[tuple[Step, int]]) -> None:
        """Computes one batch, hands each step its chunk's output and finishes the steps that are complete."""
        for step, _ in batch:
            self.sessions.enter_batch(step.session)
        self.computing = True
        inline = self._computes_inline(batch)
        computed = batch
        try:
            outputs, compute_ms, cpu_ms, computed, span = await self._forward_isolated(batch, inline=inline,
                                                                                       joinable=not inline)
        finally:
            self.computing = False
            for step, _ in computed:  # the steps that joined it too
                self.sessions.leave_batch(step.session)
        self._settle(computed, outputs, compute_ms, cpu_ms, joined=len(computed) - len(batch),
                     place="loop" if inline else "pool", span=span)

    def _settle(self, batch: list[tuple[Step, int]], outputs: list[torch.Tensor | SwarmError], compute_ms: float,
                cpu_ms: float, *, joined: int, place: str, passed: bool = False,
                span: tuple[float, float] | None = None) -> None:
        """Counts a computed batch (`joined`: how many of its steps joined it; `passed`: decode steps that passed a
        prompt's chunk; `span`: when it started and ended on the computing thread, `time.perf_counter()`), hands each
        step its chunk's output and finishes the steps that are complete."""
        if self.trace is not None and span is not None:
            self.trace(batch_record(batch, span, compute_ms, cpu_ms, joined=joined, place=place, passed=passed))
        self.stats.joined += joined
        decode = any(step.tokens == 1 for step, _ in batch)
        prefill_tokens = sum(take * step.rows for step, take in batch if step.tokens > 1)
        prefill = prefill_tokens > 0
        self.stats.note(len(batch), sum(take * step.rows for step, take in batch), compute_ms=compute_ms,
                        mixed=decode and prefill, place=place, prefill_tokens=prefill_tokens, cpu_ms=cpu_ms)
        self._note_speed(batch, compute_ms, joined=joined)
        if len(batch) == 1 and batch[0][0].rows * batch[0][1] == 1 and compute_ms > 0:
            sample_ms = compute_ms / batch[0][0].session.blocks  # a lone decode step refines the start-up figure
            self.block_compute_ms = 0.9 * self.block_compute_ms + 0.1 * sample_ms
        finished = []
        for step, _ in batch:
            step.beside_prefill |= prefill
        for (step, take), output in zip(batch, outputs, strict=True):
            if isinstance(output, SwarmError):
                self._drop(step, output)
                continue
            step.outputs.append(output.view(step.rows, take, -1))
            step.done += take
            step.compute_ms += compute_ms
            if step.remaining and step.stopping:
                self._stopped(step)
                continue
            if step.remaining == 0:
                self._queue.remove(step)
                self._commit(step)
                finished.append(step)
                if step.tokens == 1:
                    latency_ms = (time.perf_counter() - step.admitted_s) * 1000
                    if passed:
                        self.stats.decode_passing_prefill.note(latency_ms)
                    elif step.beside_prefill:
                        self.stats.decode_beside_prefill.note(latency_ms)
                        self.stats.decode_beyond_batch.note(max(0.0, latency_ms - compute_ms))
                    else:
                        self.stats.decode_alone.note(latency_ms)
        self._finish(finished)

    def _note_speed(self, batch: list[tuple[Step, int]], compute_ms: float, *, joined: int) -> None:
        """Logs a batch that took `SLOW_BATCH_FACTOR` times the usual compute per token and block (at least
        `SLOW_BATCH_MIN_MS`), with what it held, then counts it in the usual."""
        token_blocks = sum(take * step.rows * step.session.blocks for step, take in batch)
        if token_blocks == 0 or compute_ms <= 0:
            return
        per_token_block = compute_ms / token_blocks
        usual = self._usual_ms
        if usual is not None and compute_ms >= SLOW_BATCH_MIN_MS and per_token_block > SLOW_BATCH_FACTOR * usual:
            log.warning("a batch took %.0f ms of compute, %.0fx the usual per token and block: %d step(s) (%d joined), "
                        "%d token(s) over %d block(s) in all, %d open session(s)", compute_ms, per_token_block / usual,
                        len(batch), joined, sum(take * step.rows for step, take in batch), token_blocks,
                        len(self.sessions))
        self._usual_ms = per_token_block if usual is None else 0.95 * usual + 0.05 * per_token_block

    async def _forward_isolated(
        self, batch: list[tuple[Step, int]], *, inline: bool, joinable: bool
    ) -> tuple[list[torch.Tensor | SwarmError], float, float, list[tuple[Step, int]], tuple[float, float]]:
        """Gives each step's output rows for its chunk (or its error), the batch's compute time and its computing
        thread's CPU time in ms, the steps computed (`batch`, then those that joined it), and when the computing
        began and ended (`time.perf_counter()`). A batch that fails is computed again one step at a time, so that only
        the steps that fail alone fail."""
        running = _Pass(items=list(batch), tokens=sum(take * step.rows for step, take in batch),
                        prefill=any(step.tokens > 1 for step, _ in batch))
        try:
            output, compute_ms = await self._forward(running, inline=inline, joinable=joinable)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            computed = running.items  # the batch, and whatever joined it before it failed
            began = running.started_s or time.perf_counter()
            if len(computed) == 1:
                return [_typed(error, computed[0][0])], 0.0, running.cpu_ms, computed, (began, time.perf_counter())
            log.warning("a batch of %d steps failed (%s: %s); computing them one by one", len(computed),
                        type(error).__name__, error)
            results: list[torch.Tensor | SwarmError] = []
            total_ms, cpu_ms = 0.0, running.cpu_ms
            for item in computed:
                alone, alone_ms, alone_cpu_ms, _, _ = await self._forward_isolated([item], inline=False,
                                                                                    joinable=False)
                results.extend(alone)
                total_ms += alone_ms
                cpu_ms += alone_cpu_ms
            return results, total_ms, cpu_ms, computed, (began, time.perf_counter())
        sizes = [take * step.rows for step, take in running.items]
        span = (running.started_s, running.ended_s)
        return list(output.split(sizes)), compute_ms, running.cpu_ms, running.items, span

    def _assemble(self, batch: list[tuple[Step, int]]) -> tuple[torch.Tensor, PagedBatch]:
        """Gives the rows and the chunks of `batch`'s tokens, in order."""
        chunks: list[SequenceChunk] = []
        parts = []
        row = 0
        for step, take in batch:
            chunks += step.session.chunks(row, step.done, take)
            parts.append(step.hidden[:, step.done : step.done + take].reshape(-1, step.hidden.shape[-1]))
            row += take * step.rows
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), PagedBatch(tuple(chunks))

    async def _forward(self, running: _Pass, *, inline: bool, joinable: bool) -> tuple[torch.Tensor, float]:
        """Gives the output rows of `running`'s steps (and of those that join it) and the compute time in ms."""
        hidden, paged = self._assemble(running.items)
        running.blocks = max(c.block_end for c in paged.chunks) - min(c.block_start for c in paged.chunks)
        if inline:  # nothing joins it (it is not `self._pass`); it takes its CPU time
            return self._timed_forward(hidden, paged, running)
        if joinable:
            self._pass = running
        future: Future[tuple[torch.Tensor, float]] = self._executor.submit(self._timed_forward, hidden, paged, running)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.result()  # the thread still writes into the batch's pages: they stay held until it is done
            raise
        finally:
            self._pass = None
            with running.lock:
                running.closed = True
                late = running.joining + running.passing
                running.joining, running.passing = [], []
            for step, _, _, _ in late:  # came too late to join or pass: they wait in the queue for the next batch
                self.sessions.leave_batch(step.session)

    def _timed_forward(
        self, hidden: torch.Tensor, batch: PagedBatch, running: _Pass | None
    ) -> tuple[torch.Tensor, float]:
        """Gives the pass's output rows (the batch's, then each joined step's) and its compute time in ms, and adds
        this thread's CPU time to `running`'s. Between two blocks it takes in the steps that `running` collected
        meanwhile."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        if running is not None:
            running.started_s = started
        forward_pass = ForwardPass(self.blocks, self.kv, hidden, batch)
        held_ms = 0.0  # an emulated GPU's time for the blocks done so far
        while True:
            if running is not None:
                with running.lock:
                    joining, running.joining = running.joining, []
                    passing, running.passing = running.passing, []
                    if forward_pass.done:
                        running.closed = True
                    elif passing:
                        running.passes += 1  # later decode steps ride it
                if passing and forward_pass.done:  # too late: returned to the queue
                    with running.lock:
                        running.passing.extend(passing)
                elif passing:
                    held_ms += self._pass_ahead(running, passing)
                if joining and forward_pass.done:  # too late: returned to the queue
                    with running.lock:
                        running.joining.extend(joining)
                elif joining:  # every step that came since the last block catches up in one pass, then joins
                    rows, chunks = _merged([(rows, chunks) for _, _, rows, chunks in joining])
                    if self.hold_ms is not None:
                        held_ms += sum(self.hold_ms(chunks, block)
                                       for block in range(forward_pass.first_block, forward_pass.next_block))
                    forward_pass.join(rows, chunks)
                    running.items.extend((step, take) for step, take, _, _ in joining)
                running.blocks_done = forward_pass.next_block - forward_pass.first_block
            if forward_pass.done:
                break
            block = forward_pass.next_block
            forward_pass.advance()
            if self.hold_ms is not None:
                held_ms += self.hold_ms(forward_pass.batch, block)
                remaining_s = held_ms / 1000 - (time.perf_counter() - started)
                if remaining_s > 0:
                    time.sleep(remaining_s)
        output = forward_pass.hidden
        if output.device.type == "cuda":
            torch.cuda.synchronize(output.device)
        ended = time.perf_counter()
        compute_ms = (ended - started) * 1000
        if running is not None:  # less the passes of the decode steps that passed it, which count as their own
            running.ended_s = ended
            running.cpu_ms += (time.thread_time() - cpu_started) * 1000 - running.passed_cpu_ms
            compute_ms -= running.passed_ms
        return output, compute_ms

    def _pass_ahead(self, running: _Pass, passing: list[tuple[Step, int, torch.Tensor, PagedBatch]]) -> float:
        """Computes the decode steps `passing` through all their blocks, ahead of the rest of `running`, and hands
        them to the event loop (`_passed`); gives an emulated GPU's time for them, which `running` waits out too. Runs
        on the compute thread, between two blocks of `running`."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        rows, chunks = _merged([(rows, chunks) for _, _, rows, chunks in passing])
        held_ms = 0.0
        output: torch.Tensor | None = None
        error: Exception | None = None
        try:
            ahead = ForwardPass(self.blocks, self.kv, rows, chunks)
            while not ahead.done:
                block = ahead.next_block
                ahead.advance()
                if self.hold_ms is not None:
                    held_ms += self.hold_ms(ahead.batch, block)
            if held_ms / 1000 > time.perf_counter() - started:
                time.sleep(held_ms / 1000 - (time.perf_counter() - started))
            output = ahead.hidden
            if output.device.type == "cuda":
                torch.cuda.synchronize(output.device)
        except Exception as failed:  # the steps go back to the queue, where a step that fails alone fails alone
            error = failed
        ended = time.perf_counter()
        compute_ms = (ended - started) * 1000
        cpu_ms = (time.thread_time() - cpu_started) * 1000
        running.passed_ms += compute_ms
        running.passed_cpu_ms += cpu_ms
        assert self._loop is not None, "the scheduler computes only once started"
        try:
            self._loop.call_soon_threadsafe(self._passed, [(step, take) for step, take, _, _ in passing], output,
                                            error, compute_ms, cpu_ms, (started, ended))
        except RuntimeError:  # the loop has closed (the process is ending): no one is left to answer
            pass
        return held_ms

    def _passed(self, batch: list[tuple[Step, int]], output: torch.Tensor | None, error: Exception | None,
                compute_ms: float, cpu_ms: float, span: tuple[float, float] | None = None) -> None:
        """Finishes the decode steps that passed a prompt's chunk (on the event loop, while the chunk computes on);
        if their pass failed, they wait in the queue for the next batch instead."""
        for step, _ in batch:
            self.sessions.leave_batch(step.session)
        if error is not None:
            log.warning("%d decode step(s) passing a prompt's chunk failed (%s: %s); they go in the next batch",
                        len(batch), type(error).__name__, error)
            self._ready.set()
            return
        assert output is not None
        queued = {id(step) for step in self._queue}
        kept = [(i, item) for i, item in enumerate(batch) if id(item[0]) in queued]  # not failed meanwhile (a stop)
        rows = list(output.split([take * step.rows for step, take in batch]))
        if not kept:
            return
        self.stats.passed += len(kept)
        self._settle([item for _, item in kept], [rows[i] for i, _ in kept], compute_ms, cpu_ms, joined=0,
                     place="pool", passed=True, span=span)

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

    @staticmethod
    def _commit(step: Step) -> None:
        """Makes a complete step's tokens part of its session's history."""
        session = step.session
        output = step.outputs[0] if len(step.outputs) == 1 else torch.cat(step.outputs, dim=1)
        session.position += step.tokens
        session.last_step_id, session.last_result = step.step_id, StepResult(output, step.compute_ms, len(step.outputs))
        session.last_active_s = time.monotonic()
        session.note_committed(step.tokens, session.last_active_s)
        session.running = None

    def _finish(self, steps: list[Step]) -> None:
        """Lets the server push committed steps on, then resolves their results."""
        if not steps:
            return
        try:
            self.on_steps_done(steps)
        except Exception:  # a failing push must not keep the steps' replies from their clients
            log.exception("after-batch hook failed")
        finally:
            for step in steps:
                assert step.session.last_result is not None
                step.result.set_result(step.session.last_result)
                for observer in self.step_observers:
                    observer(step.tokens, step.admitted_s)

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


def _merged(parts: list[tuple[torch.Tensor, PagedBatch]]) -> tuple[torch.Tensor, PagedBatch]:
    """Gives one batch of several batches' rows, in order, their chunks' rows renumbered to follow each other."""
    if len(parts) == 1:
        return parts[0]
    chunks: list[SequenceChunk] = []
    offset = 0
    for rows, batch in parts:
        chunks += [replace(chunk, row=chunk.row + offset) for chunk in batch.chunks]
        offset += rows.shape[0]
    return torch.cat([rows for rows, _ in parts]), PagedBatch(tuple(chunks))


def _typed(error: Exception, step: Step) -> SwarmError:
    if isinstance(error, SwarmError):
        return error
    log.error("step of session %s failed: %s: %s", step.session.session_id, type(error).__name__, error,
              exc_info=error)
    return InternalServerError(f"{type(error).__name__}: {error}")
