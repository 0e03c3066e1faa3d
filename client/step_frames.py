"""Decode steps of several sessions bound for one server, sent in one `steps` frame.

The sessions of one LM head pass send their next steps together (`client.batched_head.SendGate`), and each session
talks to each server of its chain on a stream of its own. Sent one per stream, eight steps reach the first server
spread over a millisecond or two: it starts computing the first and takes in the others between blocks, each after
catching up through the blocks it missed. Here the steps that are handed over within a few passes of the client's
event loop leave in one frame per server instead, on the stream of the first of them; the server admits them all
before it computes, and answers every step's output (or error) in one reply. A lone session's step goes out on its
own stream at once, as a plain `step` call.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import MalformedFrame, SwarmError
from swarm.rpc import RpcConnection
from swarm.wire import MAX_STEPS_PER_FRAME

MAX_GATHER_PASSES = 8  # event loop passes a frame waits for more steps while more keep coming
QUIET_PASSES = 2  # passes without a new step after which the frame leaves


@dataclass
class _Outbox:
    """The steps bound for one server that wait for their frame to leave."""

    entries: list[tuple[RpcConnection, dict[str, Any], asyncio.Future[dict[str, Any]]]] = field(default_factory=list)
    sender: asyncio.Task[None] | None = None  # sends the frame once the steps are gathered


class StepFrames:
    """Gathers the decode steps bound for each server into `steps` frames. Used on the client's loop only."""

    def __init__(self) -> None:
        self._outboxes: dict[str, _Outbox] = {}
        self.frames = 0  # `steps` frames sent so far
        self.framed_steps = 0  # steps they carried

    async def call(self, connection: RpcConnection, payload: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """Gives the server's reply to the `step` call `payload` on `connection`, sent in one frame with the other
        steps for the same server that are handed over meanwhile."""
        outbox = self._outboxes.get(connection.peer_id)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if outbox is None:
            outbox = self._outboxes[connection.peer_id] = _Outbox()
            outbox.sender = asyncio.ensure_future(self._send_when_gathered(connection.peer_id, outbox, timeout))
        outbox.entries.append((connection, payload, reply))
        return await reply

    async def _send_when_gathered(self, peer_id: str, outbox: _Outbox, timeout: float) -> None:
        """Sends the outbox once two passes of the loop brought no more steps to it (a session's step reaches it two
        passes after its gate opened), or once it is full."""
        quiet = 0
        for _ in range(MAX_GATHER_PASSES):
            gathered = len(outbox.entries)
            await asyncio.sleep(0)
            quiet = quiet + 1 if len(outbox.entries) == gathered else 0
            if quiet >= QUIET_PASSES or len(outbox.entries) >= MAX_STEPS_PER_FRAME:
                break
        if self._outboxes.get(peer_id) is outbox:
            del self._outboxes[peer_id]
        entries = outbox.entries
        while entries:
            frame, entries = entries[:MAX_STEPS_PER_FRAME], entries[MAX_STEPS_PER_FRAME:]
            await self._send(frame, timeout)

    async def _send(
        self, frame: list[tuple[RpcConnection, dict[str, Any], asyncio.Future[dict[str, Any]]]], timeout: float
    ) -> None:
        connection = frame[0][0]
        try:
            if len(frame) == 1:
                replies: list[dict[str, Any] | SwarmError] = [await connection.call("step", frame[0][1],
                                                                                  timeout=timeout)]
            else:
                answer = await connection.call("steps", {"steps": [payload for _, payload, _ in frame]},
                                               timeout=timeout)
                replies = _results(answer, len(frame))
                self.frames += 1
                self.framed_steps += len(frame)
        except asyncio.CancelledError:
            for _, _, reply in frame:
                reply.cancel()
            raise
        except Exception as error:  # the frame failed as a whole: so does every step in it
            for _, _, reply in frame:
                if not reply.done():
                    reply.set_exception(error)
            return
        for (_, _, reply), result in zip(frame, replies, strict=True):
            if reply.done():
                continue
            if isinstance(result, SwarmError):
                reply.set_exception(result)
            else:
                reply.set_result(result)


def _results(answer: dict[str, Any], count: int) -> list[dict[str, Any] | SwarmError]:
    """Gives each step's reply map or typed error from a `steps` answer."""
    results = answer.get("results")
    if not isinstance(results, list) or len(results) != count:
        raise MalformedFrame(f"a steps frame of {count} steps was answered with {results!r:.100}")
    return [SwarmError.from_wire(result["error"]) if isinstance(result, dict) and "error" in result
            else result for result in results]
