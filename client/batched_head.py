"""The LM head shared by every session of one client process, computing concurrent callers in one pass.

A decode step's logits read the whole LM head (SmolLM2: 49152 x 576 weights, 113 MB in float32) for one row, so a
process that runs many sessions (threads of one client, an API server) spends much of its time streaming those
weights once per session. As the servers batch their steps, the head batches its callers, and it keeps them in step:
a pass waits for the decode steps of this process's sessions on the same chain that are on their way through the
swarm (the client knows which ones it sent), then computes every row at once, and the sessions go on together.
Sessions that move together meet the servers together, where they compute in one batch instead of one after the
other; this is the client's half of iteration-level batching, as vLLM's engine steps all running requests at once. A
lone session never waits, and a step that does not come back within `MAX_GANG_WAIT_S` is not waited for.

The steps of one pass leave together too: each waits on the client's event loop at its pass's `SendGate` until all
of them have been handed to the loop, and then all are written within one or two loop iterations. The first
server reads them in one go and computes them in one batch from its first block on, instead of starting with the
first and taking in the others between blocks, each after catching up through the blocks it missed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from swarm.model import ClientHead

MAX_GANG_WAIT_S = 0.5  # bounds how long a pass waits for decode steps still on their way
MAX_TRACKED_PASSES = 64  # gates kept, one per pass and group
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
    group: Hashable
    pass_id: int = 0
    finished: bool = False
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class BatchedHead:
    """Logits of many threads' hidden states, computed together, for sessions that go on together.

    Sessions are kept in step by group: the sessions on one chain of servers (the caller names the group, e.g. by
    its route). A pass waits only for the decode steps of its own group; sessions on other chains, which meet other
    servers and come back at their own pace, never hold it up, so a process whose sessions spread over fast and slow
    chains runs each at its own chain's speed. A pass still computes the rows of every group that is not waiting
    for steps of its own."""

    def __init__(self, head: ClientHead) -> None:
        self.head = head
        self._changed = threading.Condition()
        self._waiting: list[_Request] = []
        self._busy = False
        self._in_flight: Counter[Hashable] = Counter()  # per group: decode steps sent whose output is not back
        self._arrived: Counter[Hashable] = Counter()  # per group: outputs back whose threads have not asked yet
        self._gates: dict[tuple[int, Hashable], SendGate] = {}  # (pass, group) -> its sessions' next steps' gate
        self._thread = threading.local()  # the pass that gave this thread its last logits
        self.passes = 0  # head passes computed so far
        self.rows = 0  # rows they computed

    def step_sent(self, group: Hashable = None) -> SendGate | None:
        """Notes a decode step of `group` about to be sent into the swarm; its thread will ask for logits once it
        comes back. Gives the gate through which the step leaves with the others of its group in this thread's last
        pass (None for a lone session): the caller awaits `gate.wait()` on the client's loop before sending."""
        with self._changed:
            self._in_flight[group] += 1
            return self._gates.get((getattr(self._thread, "pass_id", None), group))

    def step_returned(self, group: Hashable = None) -> None:
        """Notes that a sent step's output arrived (called on the client's loop, before its thread wakes)."""
        with self._changed:
            self._take(self._in_flight, group)
            self._arrived[group] += 1
            self._changed.notify_all()

    def step_failed(self, group: Hashable = None, *, returned: bool) -> None:
        """Takes back a sent step whose thread will not ask for logits (its step or what followed failed)."""
        with self._changed:
            self._take(self._arrived if returned else self._in_flight, group)
            self._changed.notify_all()

    def logits(self, hidden: torch.Tensor, group: Hashable = None, *, sent: bool = False) -> torch.Tensor:
        """Gives the next-token logits of `hidden` ([..., hidden]), in one pass with the rows of the other sessions
        of `group` (and of any other group that is not waiting for its own); `sent`: `hidden` is the output of a step
        announced with `step_sent(group)`."""
        request = _Request(hidden.reshape(-1, hidden.shape[-1]), group)
        with self._changed:
            if sent:
                self._take(self._arrived, group)
            self._waiting.append(request)
            self._changed.notify_all()
            deadline = time.monotonic() + MAX_GANG_WAIT_S
            while not request.finished:
                if self._busy:  # another thread is computing a pass: this request goes in the next one
                    self._changed.wait()
                    continue
                remaining_s = deadline - time.monotonic()
                if not self._expects(group) or remaining_s <= 0:
                    break
                self._changed.wait(remaining_s)  # rows of this chain's sessions still on their way: wait for them
            lead = not request.finished
            if lead:
                self._busy = True
                batch = [r for r in self._waiting if r is request or r.group == group or not self._expects(r.group)]
                self._waiting = [r for r in self._waiting if not any(r is taken for taken in batch)]
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

    def _expects(self, group: Hashable) -> bool:
        """Gives whether rows of `group` are still to come: steps in the swarm or back but not yet asked for."""
        return bool(self._in_flight[group] or self._arrived[group])

    @staticmethod
    def _take(counts: Counter[Hashable], group: Hashable) -> None:
        if counts[group] > 1:
            counts[group] -= 1
        else:
            counts.pop(group, None)

    def _compute(self, batch: list[_Request]) -> None:
        try:
            rows = torch.cat([request.hidden for request in batch]) if len(batch) > 1 else batch[0].hidden
            logits = self.head.logits(rows)
            self.passes += 1
            members = Counter(request.group for request in batch)
            with self._changed:
                for request in batch:
                    request.pass_id = self.passes
                for group, count in members.items():
                    if count > 1:
                        self._gates[(self.passes, group)] = SendGate(count)
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
