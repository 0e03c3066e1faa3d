"""The LM head shared by every session of one client process, computing concurrent callers in one pass.

A decode step's logits read the whole LM head (SmolLM2: 49152 x 576 weights, 113 MB in float32) for one row, so
a process that runs many sessions (threads of one client, an API server) spends much of its time streaming those
weights once per session. As the servers batch their steps, the head batches its callers, and it keeps them in
step: a pass waits for the decode steps of this process that are on their way through the swarm (the client knows
which ones it sent), then computes every row at once, and the sessions go on together. Sessions that move together
meet the servers together, where they compute in one batch instead of one after the other; this is the client's
half of iteration-level batching, as vLLM's engine steps all running requests at once. A lone session never waits,
and a step that does not come back within `MAX_GANG_WAIT_S` is not waited for.

The steps of one pass leave together too: each waits on the client's event loop at its pass's `SendGate` until all
of them have been handed to the loop, and then all are written within one or two loop iterations. The first
server reads them in one go and computes them in one batch from its first block on, instead of starting with the
first and taking in the others between blocks, each after catching up through the blocks it missed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import torch

from swarm.model import ClientHead

MAX_GANG_WAIT_S = 0.5  # bounds how long a pass waits for decode steps still on their way
MAX_TRACKED_PASSES = 64
MAX_SEND_WAIT_S = 0.01  # bounds how long a session waits for the others of its pass to send their next steps


class SendGate:
    """The next steps of one head pass's sessions, held on the client's event loop until all of them are there (or
    `MAX_SEND_WAIT_S` has passed), so that they are written to the first server together. Used on the loop only."""

    def __init__(self, members: int) -> None:
        self.members = members
        self.arrived = 0
        self._open: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        """Returns once every session of the pass is ready to send, or once the wait is up for all of them; the
        waiting ones all resume in one loop pass."""
        loop = asyncio.get_running_loop()
        if self._open is None:
            self._open = loop.create_future()
            # past the deadline the others went elsewhere (their generation ended): nobody waits for them again
            loop.call_later(MAX_SEND_WAIT_S, self._release)
        self.arrived += 1
        if self.arrived >= self.members:
            self._release()
        await asyncio.shield(self._open)

    def _release(self) -> None:
        if self._open is not None and not self._open.done():
            self._open.set_result(None)


@dataclass
class _Request:
    hidden: torch.Tensor  # [rows, hidden]
    pass_id: int = 0
    finished: bool = False
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class BatchedHead:
    """Logits of many threads' hidden states, computed together, for sessions that go on together."""

    def __init__(self, head: ClientHead) -> None:
        self.head = head
        self._changed = threading.Condition()
        self._waiting: list[_Request] = []
        self._busy = False
        self._in_flight = 0  # decode steps sent into the swarm whose output has not come back
        self._arrived = 0  # outputs that came back whose threads have not asked for their logits yet
        self._gates: dict[int, SendGate] = {}  # pass -> the gate its sessions' next steps leave through
        self._thread = threading.local()  # the pass that gave this thread its last logits
        self.passes = 0  # head passes computed so far
        self.rows = 0  # rows they computed

    def step_sent(self) -> SendGate | None:
        """Notes a decode step about to be sent into the swarm; its thread will ask for logits once it comes back.
        Gives the gate through which the step leaves with the others of this thread's last pass (None for a lone
        session): the caller awaits `gate.wait()` on the client's loop before sending."""
        with self._changed:
            self._in_flight += 1
            return self._gates.get(getattr(self._thread, "pass_id", None))

    def step_returned(self) -> None:
        """Notes that a sent step's output arrived (called on the client's loop, before its thread wakes)."""
        with self._changed:
            self._in_flight = max(0, self._in_flight - 1)
            self._arrived += 1
            self._changed.notify_all()

    def step_failed(self, *, returned: bool) -> None:
        """Takes back a sent step whose thread will not ask for logits (its step or what followed failed)."""
        with self._changed:
            if returned:
                self._arrived = max(0, self._arrived - 1)
            else:
                self._in_flight = max(0, self._in_flight - 1)
            self._changed.notify_all()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gives the next-token logits of `hidden` ([..., hidden]), in one pass with the other sessions' rows."""
        request = _Request(hidden.reshape(-1, hidden.shape[-1]))
        with self._changed:
            self._arrived = max(0, self._arrived - 1)
            self._waiting.append(request)
            self._changed.notify_all()
            deadline = time.monotonic() + MAX_GANG_WAIT_S
            while not request.finished:
                if self._busy:  # another thread is computing a pass: this request goes in the next one
                    self._changed.wait()
                    continue
                remaining_s = deadline - time.monotonic()
                if not (self._in_flight or self._arrived) or remaining_s <= 0:
                    break
                self._changed.wait(remaining_s)  # rows of sessions still on their way: wait for them
            lead = not request.finished
            if lead:
                self._busy = True
                batch, self._waiting = self._waiting, []
        if lead:
            try:
                self._compute(batch)
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()
        if request.error is not None:
            raise request.error
        assert request.logits is not None
        self._thread.pass_id = request.pass_id
        return request.logits.view(*hidden.shape[:-1], -1)

    def _compute(self, batch: list[_Request]) -> None:
        try:
            rows = torch.cat([request.hidden for request in batch]) if len(batch) > 1 else batch[0].hidden
            logits = self.head.logits(rows)
            self.passes += 1
            with self._changed:
                for request in batch:
                    request.pass_id = self.passes
                if len(batch) > 1:
                    self._gates[self.passes] = SendGate(len(batch))
                    while len(self._gates) > MAX_TRACKED_PASSES:
                        self._gates.pop(next(iter(self._gates)))
            self.rows += rows.shape[0]
            offset = 0
            for request in batch:
                request.logits = logits[offset : offset + request.hidden.shape[0]]
                offset += request.hidden.shape[0]
        except BaseException as error:  # every caller of this pass gets the error, not only the leader
            for request in batch:
                request.error = error
        finally:
            for request in batch:
                request.finished = True
