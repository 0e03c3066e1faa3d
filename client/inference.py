"""Inference sessions through a chain of servers, with failover that replays a lost segment's saved inputs.

As in Petals, the client keeps every input it sent to each server span. When a server fails, the client routes
around it for exactly that span's blocks, opens sessions on the replacement servers, replays the saved inputs
through them (rebuilding their KV caches), and continues. Greedy outputs match an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from client.chain_lease import ChainLease
from client.routing import Span
from client.swarm_client import SwarmClient
from client.verification import CheckStats, SpotChecker
from orchestrator.admission import BUSY_BACKOFF_FIRST_S, busy_retry_wait
from swarm.errors import (
    BlocksDropped,
    BlocksNotHosted,
    ChainChanged,
    Hop,
    InternalServerError,
    MalformedFrame,
    MaxLengthExceeded,
    NoRouteFound,
    PeerUnreachable,
    PositionMismatch,
    QuotaExceeded,
    RpcTimeout,
    ServerBusy,
    ServerDraining,
    SessionMoved,
    SessionNotFound,
    StepStopped,
    SwarmError,
)
from swarm.records import MAX_NEXT_HOPS, NextHop, ServerRecord
from swarm.rpc import RpcConnection
from swarm.wire import decode_tensor, encode_tensor

log = logging.getLogger(__name__)

PUSH_WAIT_MARGIN_MS = 500.0
MAX_MOVES_PER_STEP = 8  # a session that keeps moving while one step waits is failed over instead

# Errors after which another server may succeed; anything else (bad input, max length) goes to the caller.
RECOVERABLE = (
    PeerUnreachable, RpcTimeout, ServerDraining, ServerBusy, SessionNotFound, InternalServerError, PositionMismatch,
    BlocksDropped, StepStopped,
)
# Failures that say nothing against the server (it is full, moved the session, or dropped blocks to hold more KV):
# its replacement chain may go through it again, and it is not banned.
NOT_THE_SERVERS_FAULT = (ServerBusy, SessionMoved, BlocksDropped, ChainChanged, StepStopped)
# When opening a session, a stale record (blocks no longer hosted) or a lower --max-length also means: try another.
RECOVERABLE_AT_OPEN = (*RECOVERABLE, BlocksNotHosted, MaxLengthExceeded)


@dataclass
class ClientStepTimes:
    """Where a session's decode steps spent their time on the client's side, summed over its steps (ms,
    `time.perf_counter()`): the thread hands a step to the client's event loop (`to_loop_ms`), the step waits at its
    head pass's send gate for the other sessions of that pass (`gate_ms`), crosses the swarm (`swarm_ms`: from its
    send to its output's arrival on the loop, every span and failover included), and its output waits for the thread
    to wake up (`to_thread_ms`); the thread's LM head call waits for its chain's other steps and computes the pass
    (`head_ms`); what is left until the thread sends the next step is `generate()`'s own work (`between_ms`: sampling,
    stopping, the next token's embedding). A token's time is about the sum of these over one step."""

    steps: int = 0
    to_loop_ms: float = 0.0
    gate_ms: float = 0.0
    swarm_ms: float = 0.0
    to_thread_ms: float = 0.0
    head_ms: float = 0.0
    between_ms: float = 0.0
    head_returned_s: float | None = None  # when the last head call returned (the start of the next `between_ms`)


@dataclass
class SpanTimings:
    """Per-server timings of one session: round trips, the server's own compute time, and when its output came.

    `output_at_ms` sums, over steps, the time from the step's start to this server's output reaching the client.
    It means the same whether the client called the servers one after another or they pushed the step along
    (where the round trips overlap and say little about one server's share). `first_sent_s` and `first_received_s`
    stamp the session's first step here (its prompt, `time.perf_counter()`): when the client sent it and when the
    reply came.
    """

    peer_id: str
    blocks: tuple[int, int]
    public_name: str | None
    steps: int = 0
    round_trip_ms: float = 0.0
    compute_ms: float = 0.0
    batches: int = 0  # batches the server computed this session's steps in (a long prompt takes several)
    output_at_ms: float = 0.0
    first_sent_s: float | None = None
    first_received_s: float | None = None


@dataclass(frozen=True)
class OpenAttempt:
    """One try of a session to find a chain and open it (`time.perf_counter()` stamps): how a busy swarm's wait
    splits into routing, refusals and back-off sleeps.

    `kind` is "route" (a DHT lookup and RTT probes; `peer_id` None), "open" (an `open` call to `peer_id`) or
    "backoff" (a sleep while every server was busy); `outcome` is "ok", the refusal's error type, "no route" or,
    for a back-off, its planned length in seconds as text."""

    kind: str
    started_s: float
    ended_s: float
    peer_id: str | None = None
    outcome: str = "ok"


@dataclass(frozen=True)
class ChainFollow:
    """A step's span answered `ChainChanged` (a drop or restore split or merged its blocks) at `started_s`; the
    session pointed its spans at the new chain by `ended_s` (`time.perf_counter()` stamps), or, if not `followed`,
    replays instead."""

    started_s: float
    ended_s: float
    followed: bool


@dataclass
class _SpanSession:
    """One server's session in the chain, plus every input sent to it (for replay elsewhere)."""

    span: Span
    connection: RpcConnection
    session_id: str
    history: list[torch.Tensor] = field(default_factory=list)
    position: int = 0
    steps_in_flight: int = 0  # step calls sent on `connection` whose reply has not come
    # Whether `history` holds every input since the session's first token. A part split off to a server by a drop
    # (KunServe's exchange) has only the inputs sent after the split: a replay of it starts at an earlier span.
    complete: bool = True
    following: asyncio.Future[None] | None = None  # set while the client switches it to the server it moved to

    @property
    def peer_id(self) -> str:
        return self.span.peer_id


@dataclass(frozen=True)
class _Follow:
    """How a client follows a changed chain: `hops` replace its spans `first`..`last`, each at `position`."""

    hops: list[Hop]
    first: int
    last: int
    position: int


def _wait_key(wait_id: str, span: Span) -> str:
    """Gives the key a server remembers a client's wait for `span`'s blocks by (`open`'s `wait_id`)."""
    return f"{wait_id}:{span.start}:{span.end}"


class RemoteInferenceSession:
    """Async core of an inference session; `InferenceSession` is its synchronous face."""

    def __init__(self, client: SwarmClient, *, max_length: int, batch: int = 1, prompt_tokens: int = 0) -> None:
        self.client, self.max_length, self.batch = client, max_length, batch
        self.prompt_tokens = prompt_tokens
        self.lease: ChainLease | None = None
        self.spans: list[_SpanSession] = []
        self.position = 0
        self.timings: dict[str, SpanTimings] = {}
        self._step_started_s = 0.0
        self.failovers = 0
        self.moves = 0  # spans that moved to another server with their KV (no replay)
        self.open_attempts: list[OpenAttempt] = []  # every route, open and back-off of `_open_chain`, in order
        self.chain_follows: list[ChainFollow] = []
        self.closed = False
        self._on_wait: Callable[[], None] | None = None  # the running step's, while it may back off for room
        config = client.config
        self.checker = SpotChecker(config.verify_fraction, config.verify_seed) if config.verify_fraction else None

    async def open(self) -> None:
        """Opens a session on every server of a chain over blocks [0, L): the chain the orchestrator leases, if the
        swarm has one, else (or if a leased server refuses) the min-latency chain routed here."""
        self.lease = await self.client.acquire_chain(prompt_tokens=self.prompt_tokens)
        try:
            if self.lease is not None:
                try:
                    self.spans = await self._open_leased(self.lease)
                    return
                except RECOVERABLE_AT_OPEN as error:
                    log.warning("A server of the leased chain refused a session (%s: %s); routing by DHT records",
                                type(error).__name__, error.message)
            self.spans = await self._open_chain(0, self.client.num_blocks,
                                                records_max_age_s=self.client.config.records_max_age_s)
        except BaseException:  # no session: the slot goes back now, not when its renewals would have stopped
            if self.lease is not None:
                await self.lease.release(0)
                self.lease = None
            raise

    async def _open_leased(self, lease: ChainLease) -> list[_SpanSession]:
        """Gives open sessions on the servers of a leased chain, or raises (having closed what it opened)."""
        servers = {} if all(span.record for span in lease.spans) else await self.client.servers()
        opened: list[_SpanSession] = []
        try:
            for leased in lease.spans:
                record = leased.record or servers.get(leased.peer_id)
                if record is None:
                    raise BlocksNotHosted(f"leased server {leased.peer_id} is not online in the DHT")
                opened.append(await self.open_span(Span(leased.peer_id, leased.start, leased.end, record)))
            return opened
        except BaseException:
            for span_session in opened:
                await span_session.connection.close()
            raise

    async def _open_chain(self, start: int, end: int, *, busy: set[str] | None = None,
                          records_max_age_s: float = 0.0, wait_for_room: bool = True) -> list[_SpanSession]:
        """Gives open sessions on a min-latency chain over [start, end), routing around servers that refuse.

        A server that no longer hosts the blocks its record in the DHT still announced (it changed its range a moment
        ago) names the range it serves now: the route goes on at once with that range (`note_hosted`). A server that
        answers busy (no room now), or a stale one that named no range, is avoided until every server that could serve
        the blocks did; then the session waits, backing off, and asks them all again, for up to
        `ClientConfig.busy_wait_s`, as Petals' client waits for a full swarm (`busy`: servers known busy already). Other
        refusals ban the server for a while. Blocks that no online server covers (its servers restarting, say) are
        waited for up to `ClientConfig.route_wait_s`, then NoRouteFound rises. A round (until a back-off) routes every
        try on the records it looked up at its start: a lookup costs several round trips to the DHT, and a refusal is
        news of one server, which the round avoids. The first round may take the client's latest lookup instead, if it
        began at most `records_max_age_s` ago (a new session: `ClientConfig.records_max_age_s`; a replacement looks up
        anew, since something just changed); if those records give no chain, a round on fresh ones follows at once.
        Without `wait_for_room`, a round that a server refused as busy raises ServerBusy instead of backing off."""
        config = self.client.config
        now = time.monotonic()
        deadline, backoff_s = now + config.busy_wait_s, BUSY_BACKOFF_FIRST_S
        missing_deadline = now + config.route_wait_s
        busy = set(busy or ())
        refusals = 0
        corrected = 0  # records this call set to the range their server answered it serves now
        answered_busy = False  # a server refused this call for room (not only avoided from an earlier refusal)
        soon_s: float | None = None  # the earliest time a server of this round that refused it asked to be tried again
        attempts = self.open_attempts
        wait_id = uuid.uuid4().hex  # this wait, across its tries and rounds: servers count its refusals once
        refused: dict[tuple[str, str], Span] = {}  # (server, wait key) refused for room: withdrawn once it opens
        servers: dict[str, ServerRecord] | None = None  # this round's records
        if records_max_age_s > 0:
            servers = self.client.recent_servers(records_max_age_s)
        recent = servers is not None  # this round routes on an earlier lookup's records
        while refusals <= config.max_failovers:
            started = time.perf_counter()
            try:
                if servers is None:
                    servers = await self.client.servers()
                route = await self.client.route(start, end, max_length=self.max_length, batch=self.batch,
                                                avoid=busy, servers=servers)
                attempts.append(OpenAttempt("route", started, time.perf_counter()))
            except NoRouteFound:
                attempts.append(OpenAttempt("route", started, time.perf_counter(), outcome="no route"))
                if recent:  # the records may be what is out of date: a round on fresh ones, at once
                    servers, busy, recent = None, set(), False
                    continue
                missing = not busy and not await self._blocks_may_return(start, end)
                if missing and time.monotonic() + backoff_s > missing_deadline:
                    raise
                if not missing and answered_busy and not wait_for_room:
                    raise ServerBusy(f"every server of blocks {start}:{end} that could take this session is "
                                     f"busy") from None
                if not missing and time.monotonic() + backoff_s > deadline:
                    raise ServerBusy(f"every server of blocks {start}:{end} that could take this session was busy "
                                     f"for {config.busy_wait_s:g} s") from None
                wait_s, next_backoff_s = busy_retry_wait(backoff_s, soon_s)
                log.info("%s blocks %d:%d; asking again in %.2f s",
                         "No online server covers" if missing else "Every server is busy for", start, end, wait_s)
                if self._on_wait is not None:
                    on_wait, self._on_wait = self._on_wait, None
                    on_wait()
                started = time.perf_counter()
                await asyncio.sleep(wait_s)
                attempts.append(OpenAttempt("backoff", started, time.perf_counter(), outcome=f"{wait_s:g}"))
                backoff_s, busy, servers, soon_s = next_backoff_s, set(), None, None
                continue
            opened: list[_SpanSession] = []
            try:
                for span in route:
                    started = time.perf_counter()
                    opened.append(await self.open_span(span, wait_id=wait_id))
                    attempts.append(OpenAttempt("open", started, time.perf_counter(), span.peer_id))
                opened_at = {(span.peer_id, _wait_key(wait_id, span)) for span in route}  # those forget it themselves
                for (peer_id, key), span in refused.items():
                    if (peer_id, key) not in opened_at:
                        self.client.withdraw_wait(span.record, key)
                return opened
            except RECOVERABLE_AT_OPEN as error:
                attempts.append(OpenAttempt("open", started, time.perf_counter(), span.peer_id, type(error).__name__))
                log.warning("Server %s refused a session (%s: %s); rerouting", span.peer_id,
                            type(error).__name__, error.message)
                hosted = error.hosted if isinstance(error, BlocksNotHosted) else None
                if (hosted is not None and servers is not None and corrected < 2 * len(servers)
                        and self.client.note_hosted(span.peer_id, hosted, servers)):
                    corrected += 1
                    continue  # the record it routed on was stale: the route goes on with the range it serves now
                if isinstance(error, ServerBusy | BlocksNotHosted):  # full, or the record it routed on is stale
                    busy.add(span.peer_id)
                    answered_busy |= isinstance(error, ServerBusy)
                    if isinstance(error, ServerBusy) and not isinstance(error, QuotaExceeded):  # a wait for room
                        refused[span.peer_id, _wait_key(wait_id, span)] = span
                    hint_s = error.retry_after_s if isinstance(error, ServerBusy) else None
                    if hint_s is not None:
                        soon_s = hint_s if soon_s is None else min(soon_s, hint_s)
                else:
                    self.client.ban(span.peer_id)
                    refusals += 1
            finally:
                if len(opened) != len(route):
                    for span_session in opened:
                        await span_session.connection.close()
        raise NoRouteFound(f"no chain over blocks {start}:{end} accepted a session of {self.max_length} tokens")

    async def _blocks_may_return(self, start: int, end: int) -> bool:
        """Gives whether a route over [start, end) may be found soon: every block of it has a usable server now
        (online in the DHT and not banned: the route failed on an older view, e.g. just before a restore was
        announced), or the blocks without one can be loaded back by an online server that dropped them (KunServe:
        when a buddy that kept blocks leaves, the others restore at once), so that the session waits for them as
        for a busy swarm. Blocks no live server can restore fail the route as before."""
        servers = (await self.client.servers()).values()
        banned = self.client.banned()
        hosted = {block for record in servers if record.peer_id not in banned
                  for block in range(record.block_start, record.block_end)}
        restorable = {block for record in servers
                      if record.restorable_start is not None and record.restorable_end is not None
                      for block in range(record.restorable_start, record.restorable_end)}
        missing = set(range(start, end)) - hosted
        return missing <= restorable

    async def open_span(self, span: Span, *, moved_from: str | None = None, session_id: str | None = None,
                        wait_id: str | None = None) -> _SpanSession:
        """Opens a session on `span`'s server. `wait_id` names this client's wait for the blocks across its tries
        (each try opens with a new session id), so that servers count a refused wait once in their KV demand."""
        connection = await self.client.connect(span.record)
        payload: dict[str, object] = {"session_id": session_id or uuid.uuid4().hex, "blocks": [span.start, span.end],
                                      "max_length": self.max_length, "batch": self.batch}
        if wait_id is not None:
            payload["wait_id"] = _wait_key(wait_id, span)
        first_step = max(self.prompt_tokens, self.position)  # the prompt, or what a replay brings
        if first_step:
            payload["prompt_tokens"] = first_step
        if moved_from is not None:
            payload["moved_from"] = moved_from
        if self.lease is not None:
            payload["lease_id"] = self.lease.lease_id
        try:
            reply = await connection.call("open", payload, timeout=self.client.config.request_timeout_s)
        except BaseException:
            await connection.close()
            raise
        self.timings.setdefault(
            span.peer_id, SpanTimings(span.peer_id, (span.start, span.end), span.record.public_name)
        )
        return _SpanSession(span, connection, str(reply["session_id"]))

    async def step(self, hidden: torch.Tensor, *, last_only: bool = False,
                   on_wait: Callable[[], None] | None = None) -> torch.Tensor:
        """Gives the hidden states after the last block for `hidden` ([batch, new tokens, hidden]); with `last_only`,
        for its last token only (the last server sends back one row per sequence, not a prompt's every row).
        `on_wait` is called once if the step backs off (waiting for room, or for blocks no server covers)."""
        if self.closed:
            raise SessionNotFound("this inference session is closed")
        self._on_wait = on_wait
        try:
            return await self._step(hidden, last_only=last_only)
        finally:
            self._on_wait = None

    async def _step(self, hidden: torch.Tensor, *, last_only: bool) -> torch.Tensor:
        new_tokens = hidden.shape[1]
        index = 0
        self._step_started_s = time.perf_counter()
        checked = self.checker is not None and self.checker.draw()  # every span of it, so: no push
        if self.client.config.server_push and len(self.spans) > 1 and new_tokens == 1 and not checked:
            hidden, index = await self._pushed_step(hidden)
        failovers_this_step = moves_this_step = 0
        follow: SessionMoved | None = None  # the span at `index` moved: follow it, then retry the step there
        replace: SwarmError | None = None  # the span at `index` failed: replace it by a replay, then retry
        while index < len(self.spans):  # one span at a time: a step's start, or what the pushed step left over
            span_session = self.spans[index]
            recovering = follow is not None or replace is not None
            try:
                if follow is not None:
                    moved, follow = follow, None
                    await self._follow(index, moved)
                    continue  # the same step, on the server the span's KV moved to
                if replace is not None:
                    failed, replace = replace, None
                    index, hidden = await self._replace(index, hidden, busy=isinstance(failed, NOT_THE_SERVERS_FAULT))
                    continue  # retry the step from the first replacement server
                # No push here: a prefill would cross each link twice (push and client), and a pushed step that
                # stopped midway goes on from the client anyway.
                output = await self.call_step(span_session, hidden, step_id=f"{self.position}",
                                              last_only=last_only and index == len(self.spans) - 1 and not checked)
                if checked and await self._caught(span_session, hidden, output):
                    index, hidden = await self._replace(index, hidden, through=len(self.spans) - 1)
                    continue  # the step again, from the replacement
                if checked and last_only and index == len(self.spans) - 1:
                    output = output[:, -1:]
            except ChainChanged as changed:
                moves_this_step += 1
                if moves_this_step > MAX_MOVES_PER_STEP:
                    raise
                started = time.perf_counter()
                try:
                    followed = None if recovering else await self._reshape(index, changed, hidden, new_tokens)
                except SwarmError as error:  # an exception here would leave the step loop: replay instead
                    log.warning("Following a changed chain failed (%s)", error.message)
                    followed = None
                self.chain_follows.append(ChainFollow(started, time.perf_counter(), followed is not None))
                if followed is not None:
                    index, hidden = followed
                else:
                    log.warning("Session on %s changed its chain in a way this client cannot follow (%s; this "
                                "client's chain: %s); replaying it", span_session.peer_id, changed.message,
                                self._chain_text())
                    replace = changed
                continue
            except SessionMoved as moved:
                moves_this_step += 1
                if moves_this_step > MAX_MOVES_PER_STEP:
                    raise
                if recovering or not span_session.complete:  # it moved again while recovering: rebuild it
                    log.warning("Session on %s moved again while it recovered; replaying it", span_session.peer_id)
                    replace = moved
                else:
                    follow = moved
                continue
            except RECOVERABLE as error:
                failovers_this_step += 1
                if failovers_this_step > self.client.config.max_failovers:
                    raise
                log.warning("Server %s failed (%s: %s); replacing its span", span_session.peer_id,
                            type(error).__name__, error.message)
                replace = error
                continue
            span_session.history.append(hidden)
            span_session.position += hidden.shape[1]
            hidden = output
            index += 1
        self.position += new_tokens
        return hidden

    async def _caught(self, span_session: _SpanSession, hidden: torch.Tensor, output: torch.Tensor) -> bool:
        """Spot-checks the span's `output` for `hidden` on another server; gives whether its server was caught
        returning wrong outputs (it is banned then: see `client.verification`)."""
        assert self.checker is not None
        if not span_session.complete:  # a part split off by a drop has no inputs from before: nothing to recompute
            return False
        inputs = torch.cat([*span_session.history, hidden], dim=1) if span_session.history else hidden
        cheat = await self.checker.check(self, span_session.span, inputs, output)
        return cheat == span_session.peer_id

    async def _pushed_step(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Sends the step to the first server and, at the same time, asks every later server for its output.

        Each server pushes its output to the next one, so the token crosses client -> s1 -> ... -> client once,
        and the client's requests to later servers only collect outputs (kept as inputs for replay). Gives the
        output of the last span that answered and the index of the first span that did not (len(spans) when all
        did); the caller goes on from there one span at a time, where servers that already ran the step (same
        step id) answer without running it again.
        """
        step_id = f"{self.position}"
        earlier = [
            asyncio.ensure_future(
                self.call_step(self.spans[0], hidden, step_id=step_id, next_hops=self._next_hops(0), framed=True)
            )
        ]
        earlier += [
            asyncio.ensure_future(
                self.call_step(later, None, step_id=step_id, wait_ms=self._push_wait_ms(index), dtype=hidden.dtype,
                               framed=True)
            )
            for index, later in enumerate(self.spans[1:-1], start=1)
        ]
        # The last span's output ends the step, so its call runs in this coroutine rather than as one more task: the
        # step returns in the loop iteration that reads it, not after a task and a gather have finished in turn. It
        # starts once the tasks have sent their requests, so the first server's request still goes out first.
        last_index = len(self.spans) - 1
        try:
            await asyncio.sleep(0)
            last: torch.Tensor | BaseException = await self.call_step(
                self.spans[-1], None, step_id=step_id, wait_ms=self._push_wait_ms(last_index), dtype=hidden.dtype,
                framed=True,
            )
        except SwarmError as error:
            last = error
        except BaseException:
            for task in earlier:
                task.cancel()
            raise
        pending = [task for task in earlier if not task.done()]
        if pending:  # the last server answered before an earlier one's reply arrived; rare, but it must be read
            await asyncio.wait(pending)
        results = [task.exception() or task.result() for task in earlier] + [last]
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                if not isinstance(result, SwarmError):
                    raise result
                log.debug("pushed step %s stopped at span %d (%s: %s); going on span by span", step_id, index,
                          type(result).__name__, result.message)
                return hidden, index
            span_session = self.spans[index]
            span_session.history.append(hidden)
            span_session.position += hidden.shape[1]
            hidden = result
        return hidden, len(self.spans)

    def _push_wait_ms(self, index: int) -> int:
        """Gives how long span `index` should wait for its pushed step: thrice the expected time of the spans
        before it, plus a margin. It bounds only how late a lost push is noticed."""
        expected_ms = sum(
            self.client.rtt_ms(earlier.peer_id) + earlier.span.length * earlier.span.record.block_compute_ms
            for earlier in self.spans[:index]
        )
        return int(min(3 * expected_ms + PUSH_WAIT_MARGIN_MS, 1000 * self.client.config.request_timeout_s / 2))

    def _later_hops(self, index: int) -> list[NextHop]:
        """Gives the servers after span `index` in the chain."""
        return [
            NextHop(peer_id=later.peer_id, session_id=later.session_id, addrs=later.span.record.addrs,
                    start=later.span.start, end=later.span.end)
            for later in self.spans[index + 1 :]
        ]

    def _next_hops(self, index: int) -> list[NextHop]:
        """Gives the servers after span `index`, to which each server pushes its output (if pushing is on)."""
        return self._later_hops(index) if self.client.config.server_push else []

    def _then(self, span_session: _SpanSession) -> list[NextHop]:
        """Gives the servers after `span_session` without a push (a restore takes the last one's part back first)."""
        index = next((i for i, earlier in enumerate(self.spans) if earlier is span_session), len(self.spans))
        return self._later_hops(index)[:MAX_NEXT_HOPS]

    async def call_step(
        self,
        span_session: _SpanSession,
        hidden: torch.Tensor | None,
        *,
        step_id: str,
        next_hops: Sequence[NextHop] = (),
        wait_ms: int | None = None,
        dtype: torch.dtype | None = None,
        framed: bool = False,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Gives the span's output (in `dtype`, default hidden's) for the step: from `hidden`, or, with hidden None,
        the step pushed to the span's server within `wait_ms`; with `last_only`, of the last token only. A `framed`
        step (a decode step) travels in one frame with the other sessions' steps for the same server that are sent
        at the same moment."""
        config = self.client.config
        payload: dict[str, object] = {
            "session_id": span_session.session_id,
            "step_id": step_id,
            "position": span_session.position,
            "blocks": [span_session.span.start, span_session.span.end],
        }
        if not next_hops:  # the servers after this one: a restore may take the next one's part back
            then = self._then(span_session)
            if then:
                payload["then"] = [hop.to_wire() for hop in then]
        if hidden is not None:
            payload["hidden"] = encode_tensor(hidden, config.compression)
        if wait_ms is not None:
            payload["wait_ms"] = wait_ms
        if next_hops:
            payload["next"] = [hop.to_wire() for hop in next_hops]
        if config.compression:
            payload["compression"] = config.compression
        if last_only:
            payload["output"] = "last"
        started = time.perf_counter()
        span_session.steps_in_flight += 1
        try:
            if framed:
                reply = await self.client.step_frames.call(span_session.connection, payload,
                                                           timeout=config.request_timeout_s)
            else:
                reply = await span_session.connection.call("step", payload, timeout=config.request_timeout_s)
        finally:
            span_session.steps_in_flight -= 1
        received = time.perf_counter()
        timings = self.timings[span_session.peer_id]
        if timings.steps == 0:
            timings.first_sent_s, timings.first_received_s = started, received
        timings.steps += 1
        timings.round_trip_ms += (received - started) * 1000
        timings.output_at_ms += (received - self._step_started_s) * 1000
        timings.compute_ms += float(reply.get("compute_ms", 0.0))
        timings.batches += int(reply.get("batches", 1))
        return decode_tensor(reply["hidden"], dtype=dtype or (hidden.dtype if hidden is not None else None))

    async def migrate(self, index: int, peer_id: str, *, mode: str = "auto") -> dict[str, Any]:
        """Moves span `index`'s session to server `peer_id` (which must host the span's blocks) and goes on there:
        with its KV cache (mode "kv"), by replaying its inputs there ("replay"), or the one the server expects to
        end first ("auto"); gives the server's reply (the mode taken, and for "auto" both modes' expected seconds).
        Raises the typed error of a move that failed, the span then still where it was."""
        span_session = self.spans[index]
        # On a stream of its own: calls on one stream are answered in order, and the session's steps go on meanwhile
        control = await self.client.connect(span_session.span.record)
        try:
            reply = await control.call(
                "migrate", {"session_id": span_session.session_id, "peer_id": peer_id, "mode": mode},
                timeout=self.client.config.request_timeout_s,
            )
        finally:
            await control.close()
        taken = reply.get("mode")
        if taken not in ("kv", "replay"):
            raise MalformedFrame(f"server {span_session.span.peer_id} moved a session by an unknown mode {taken!r}")
        # A step sent to the source meanwhile learns of the move there (SessionMoved) and follows it itself; closing
        # its connection under it would turn that into a failover.
        current = next((i for i, s in enumerate(self.spans) if s is span_session), None)
        if current is not None and not span_session.steps_in_flight:
            await self._follow(current, SessionMoved.to(span_session.session_id, peer_id, [], mode=taken))
        return reply

    async def _follow(self, index: int, moved: SessionMoved) -> None:
        """Points span `index` at the server its session moved to, keeping its session id, position and saved
        inputs; falls back to a failover (replay) if that server is not in the DHT for the span's blocks."""
        span_session = self.spans[index]
        # The move's reply and a step's SessionMoved may both tell of one move: the second waits for the first
        if span_session.following is not None:
            await asyncio.shield(span_session.following)
            return
        if span_session.span.peer_id == moved.peer_id:
            return
        span_session.following = asyncio.get_running_loop().create_future()
        try:
            await self._switch(index, span_session, moved)
        finally:
            span_session.following.set_result(None)
            span_session.following = None

    async def _switch(self, index: int, span_session: _SpanSession, moved: SessionMoved) -> None:
        span = span_session.span
        record = (await self.client.servers()).get(moved.peer_id or "")
        hosts = record is not None and record.block_start <= span.start and span.end <= record.block_end
        if not span_session.complete and (not hosts or moved.replay):
            return  # a replay must start at an earlier span: the next step does it (see `_replace`)
        if record is None or not hosts:
            log.warning("Session on %s moved to %s, which does not announce blocks %d:%d; replaying instead",
                        span.peer_id, moved.peer_id, span.start, span.end)
            await self._replace(index)
            return
        destination = Span(record.peer_id, span.start, span.end, record)
        if moved.replay:
            await span_session.connection.close()
            try:
                # under the same id: to its segment's packing, the session arrived where it sent it
                replacement = await self.open_span(destination, moved_from=span.peer_id,
                                                   session_id=span_session.session_id)
            except SwarmError as error:  # it has no room after all: the session is gone from its source, fail over
                log.warning("Session moved from %s to %s for a replay, which refused it (%s); failing over",
                            span.peer_id, record.peer_id, error.message)
                await self._replace(index, busy=True)  # its source did nothing wrong: no ban
                return
            await self._replay_onto(span_session, [replacement])
            self.spans[index] = replacement
        else:
            connection = await self.client.connect(record)
            previous = span_session.connection
            span_session.span, span_session.connection = destination, connection
            await previous.close()
            self.timings.setdefault(record.peer_id,
                                    SpanTimings(record.peer_id, (span.start, span.end), record.public_name))
        self.moves += 1
        log.info("Session moved from %s to %s (blocks %d:%d) %s", span.peer_id, record.peer_id, span.start,
                 span.end, "by a replay" if moved.replay else "with its KV")

    async def _replace(self, index: int, hidden: torch.Tensor | None = None, *, busy: bool = False,
                       through: int | None = None) -> tuple[int, torch.Tensor | None]:
        """Replaces span `index` by a new chain over the same blocks and replays its saved inputs through it; a
        server that failed as `busy` (out of room) is only avoided while the others have room, others are banned.

        A span without its complete history (split off by a drop) is replaced together with the spans before it
        back to one that has it, whose saved inputs the replay sends; those spans already ran the current step
        (`hidden` is the failed span's input), so the step goes on from the first replacement with the first
        span's input for it. With `through`, the spans after `index` up to that one are replaced too (a span caught
        returning wrong outputs: their KV was built from its outputs). Gives the index and input to go on with.

        A session never waits for room while it holds pages elsewhere: sessions that each hold part of their chain
        and wait for the room another one holds would wait for each other (a buddy left, and the server that loads
        its blocks back has room for fewer sessions than hold spans on it). If every server that could take the
        blocks is busy, the session lets its other spans go too and waits for a chain over all its blocks, which
        the first span's saved inputs rebuild."""
        first, last = index, index if through is None else through
        while first > 0 and not self.spans[first].complete:
            first -= 1
        failed = self.spans[index]
        if not busy:
            self.client.ban(failed.peer_id)
        await self._let_go(self.spans[first : last + 1], failed)
        self.failovers += 1
        avoid = {failed.peer_id} if busy else None
        whole = first == 0 and last == len(self.spans) - 1
        try:
            replacements = await self._open_chain(self.spans[first].span.start, self.spans[last].span.end,
                                                  busy=avoid, wait_for_room=whole)
        except ServerBusy:
            log.info("Every server that could take blocks %d:%d is busy; letting the session's other spans go "
                     "while it waits", self.spans[first].span.start, self.spans[last].span.end)
            await self._let_go(self.spans[:first] + self.spans[last + 1 :], failed)
            first, last = 0, len(self.spans) - 1
            replacements = None
        head = self.spans[first]
        if first < index:  # the step's input to the first span goes again, after the replay of what came before
            hidden = head.history.pop()
            head.position -= hidden.shape[1]
        end = self.spans[last].span.end
        if replacements is None:
            replacements = await self._open_chain(head.span.start, end, busy=avoid)
        await self._replay_onto(head, replacements)
        log.info("Replaced %s (blocks %d:%d) by %s", failed.peer_id, head.span.start, end,
                 " -> ".join(f"{r.peer_id}[{r.span.start}:{r.span.end}]" for r in replacements))
        self.spans[first : last + 1] = replacements
        return first, hidden

    async def _let_go(self, span_sessions: list[_SpanSession], failed: _SpanSession) -> None:
        """Closes `span_sessions` (the pages of those on healthy servers go back to their pools now)."""
        for span_session in span_sessions:
            if span_session is not failed:
                await self._close_remote(span_session)
            await span_session.connection.close()

    async def _close_remote(self, span_session: _SpanSession) -> None:
        try:
            await span_session.connection.call("close", {"session_id": span_session.session_id},
                                               timeout=self.client.config.connect_timeout_s)
        except SwarmError as error:
            log.debug("closing a session on %s failed: %s", span_session.peer_id, error)

    async def close_span(self, span_session: _SpanSession) -> None:
        """Closes a session this session opened outside its chain (a spot-check's) and its stream."""
        await self._close_remote(span_session)
        await span_session.connection.close()

    def _chain_text(self) -> str:
        """Gives this session's chain as the logs show it: each span's server, blocks and position."""
        return " -> ".join(f"{s.peer_id}[{s.span.start}:{s.span.end}]@{s.position}" for s in self.spans)

    def _hops_to_follow(self, index: int, hops: list[Hop], position: int, step_tokens: int = 0) -> _Follow | None:
        """Gives how to follow `hops` after the span at `index` answered `ChainChanged` with them at `position`; None
        if they do not line up (the caller replays). The server's view of the chain after its own part can be old (a
        later server moved its part since, and its hops name that server twice): then the hops over the span that
        answered are followed, if they tile it, and the later span answers for itself."""
        if not hops:
            return None
        followed = self._lined_up(index, hops, position, step_tokens)
        if followed is not None:
            return followed
        span = self.spans[index].span
        own = [hop for hop in hops if span.start <= hop.start and hop.end <= span.end]
        if own and own[-1].end == span.end:
            return self._lined_up(index, own, position, step_tokens)
        return None

    def _lined_up(self, index: int, hops: list[Hop], position: int, step_tokens: int) -> _Follow | None:
        """Gives how to follow `hops` at `position` from the span at `index`, if they tile their blocks, name each
        server once, begin where a span at or before `index` begins and end where one at or after it ends, and:
        - they begin at the span that answered, and the spans they replace are at `position` (a span before it
          already ran this step); the step goes on at `index`;
        - or the servers ran the step in flight (`step_tokens` long) through them already, as a restore's merge took
          a pushed step's parts together after each ran it: the spans they replace before `index` are at
          `position`, the rest `step_tokens` behind. The merged part answers the step's id again, so the step is
          sent again from the first of them.
        Else None."""
        first = next((i for i, s in enumerate(self.spans) if s.span.start == hops[0].start), None)
        last = next((i for i, s in enumerate(self.spans) if s.span.end == hops[-1].end), None)
        if first is None or last is None or not first <= index <= last:
            return None
        if any(before.end != after.start for before, after in itertools.pairwise(hops)):
            return None
        if len({hop.peer_id for hop in hops}) < len(hops):
            return None
        ran, waiting = self.spans[first:index], self.spans[index : last + 1]
        if not ran and all(s.position == position for s in waiting):
            return _Follow(list(hops), first, last, position)
        behind = position - step_tokens
        if (step_tokens and all(s.position == position and s.history for s in ran)
                and all(s.position == behind for s in waiting)):
            return _Follow(list(hops), first, last, behind)
        return None

    async def _reshape(self, index: int, changed: ChainChanged,
                       hidden: torch.Tensor, step_tokens: int) -> tuple[int, torch.Tensor] | None:
        """Points the spans over the blocks a server split or merged (KunServe's exchange and restore) at the hops
        that run them now, keeping the saved inputs; gives the span to send the step to next and its input (`hidden`
        for the span at `index`), or None when the hops do not line up with this client's chain at the same
        position, or the step in flight's `step_tokens` behind it (the caller replays instead)."""
        followed = self._hops_to_follow(index, changed.hops, changed.position, step_tokens)
        if followed is None:
            return None
        hops, first, last, position = followed.hops, followed.first, followed.last, followed.position
        covered = self.spans[first : last + 1]
        # a span before `index` ran the step: it is sent again from there, with the input that span was given
        history = list(covered[0].history) if first == index else covered[0].history[:-1]
        step_input = hidden if first == index else covered[0].history[-1]
        ours = {s.peer_id: s for s in covered}
        # The hops come from the servers themselves, so a record is needed only to dial a server new to this chain:
        # the latest lookup's does, whatever its age. A fresh lookup took 150-330 ms in a burst (r57), at every
        # victim of a drop and every prompt a drop stopped.
        records = {hop.peer_id: ours[hop.peer_id].span.record if hop.peer_id in ours
                   else self.client.known_record(hop.peer_id) for hop in hops}
        if any(record is None for record in records.values()):
            servers = await self.client.servers()
            records = {peer: record or servers.get(peer) for peer, record in records.items()}
        reshaped: list[_SpanSession] = []
        try:
            for hop in hops:
                kept = ours.get(hop.peer_id)
                record = records[hop.peer_id]
                if record is None:
                    return None
                try:
                    connection = kept.connection if kept is not None else await self.client.connect(record)
                except SwarmError as error:  # the server the KV went to is gone: the caller replays instead
                    log.warning("Chain changed to %s, which cannot be reached (%s)", hop.peer_id, error.message)
                    return None
                head = not reshaped
                reshaped.append(_SpanSession(
                    Span(hop.peer_id, hop.start, hop.end, record), connection, hop.session_id,
                    history=history if head else [], position=position,
                    complete=covered[0].complete if head else False,
                ))
                self.timings.setdefault(hop.peer_id, SpanTimings(hop.peer_id, (hop.start, hop.end),
                                                                 record.public_name))
        finally:
            if len(reshaped) != len(hops):
                for span_session in reshaped:
                    if span_session.peer_id not in ours:
                        await span_session.connection.close()
        for span_session in covered:
            if span_session.peer_id not in {hop.peer_id for hop in hops}:
                await span_session.connection.close()
        self.spans[first : last + 1] = reshaped
        self.moves += 1
        log.info("Chain changed over blocks %d:%d at position %d: %s%s", hops[0].start, hops[-1].end, position,
                 " -> ".join(f"{hop.peer_id}[{hop.start}:{hop.end}]" for hop in hops),
                 "" if changed.position == position else f" (they ran the step; it is sent again from span {first})")
        return first, step_input

    async def _replay_onto(self, failed: _SpanSession, replacements: list[_SpanSession]) -> None:
        """Sends the inputs `failed` was given through `replacements` (a chain over its blocks), rebuilding their KV
        caches; closes them if that fails."""
        try:
            replay = torch.cat(failed.history, dim=1) if failed.history else None
            for index, replacement in enumerate(replacements):
                if replay is None:
                    break
                # the last one's output is of no use: its history's KV is what the replay is for
                output = await self.call_step(replacement, replay, step_id="replay",
                                              last_only=index == len(replacements) - 1)
                replacement.history.append(replay)
                replacement.position = replay.shape[1]
                replay = output
        except BaseException:
            for replacement in replacements:
                await replacement.connection.close()
            raise

    async def close(self) -> None:
        """Closes every server session (their pages return to the servers' pools)."""
        if self.closed:
            return
        self.closed = True
        if self.lease is not None:
            await self.lease.release(self.position)
        for span_session in self.spans:
            try:
                await span_session.connection.call(
                    "close", {"session_id": span_session.session_id}, timeout=self.client.config.connect_timeout_s
                )
            except SwarmError as error:
                log.debug("closing a session on %s failed: %s", span_session.peer_id, error)
            await span_session.connection.close()


class InferenceSession:
    """A multi-step session through the swarm: `step(hidden)` sends only new tokens; use as a context manager."""

    def __init__(self, client: SwarmClient, *, max_length: int, batch: int = 1, prompt_tokens: int = 0) -> None:
        self.client = client
        self.remote = RemoteInferenceSession(client, max_length=max_length, batch=batch, prompt_tokens=prompt_tokens)
        self.generate_offset = 0  # position where the current generate() call's input_ids begin
        self.unsent_ids: torch.Tensor | None = None  # tokens a generate() call produced but never fed back
        self.step_times = ClientStepTimes()  # its decode steps' time on the client's side (`model` adds the head's)
        client.run(self.remote.open())

    @property
    def position(self) -> int:
        """Gives how many tokens the servers hold for this session."""
        return self.remote.position

    @property
    def max_length(self) -> int:
        return self.remote.max_length

    @property
    def route(self) -> list[Span]:
        """Gives the current chain of server spans."""
        return [span_session.span for span_session in self.remote.spans]

    @property
    def failovers(self) -> int:
        return self.remote.failovers

    @property
    def moves(self) -> int:
        """Gives how many times a span moved to another server with its KV cache (no replay)."""
        return self.remote.moves

    @property
    def open_attempts(self) -> list[OpenAttempt]:
        """How the session routed by DHT records: every route, `open` call and back-off, in order (its first chain's,
        then any replacement's)."""
        return self.remote.open_attempts

    @property
    def chain_follows(self) -> list[ChainFollow]:
        """Gives each time a step learned that its chain changed, and how long following it took."""
        return self.remote.chain_follows

    @property
    def checks(self) -> CheckStats | None:
        """Gives what the spot-checks of servers' outputs found (None without `verify_fraction`)."""
        return self.remote.checker.stats if self.remote.checker is not None else None

    def migrate(self, index: int, peer_id: str, *, mode: str = "auto") -> dict[str, Any]:
        """Moves span `index` of the chain to server `peer_id`, which hosts its blocks: with its KV cache (mode
        "kv"), by a replay of its inputs there ("replay"), or the one its server expects to end first ("auto");
        gives the server's reply (the mode taken, and for "auto" the expected seconds of both)."""
        return self.client.run(self.remote.migrate(index, peer_id, mode=mode))

    def timings(self) -> list[SpanTimings]:
        """Gives per-server timings, in chain order of first use."""
        return list(self.remote.timings.values())

    def step(
        self,
        hidden: torch.Tensor,
        *,
        on_output: Callable[[], None] | None = None,
        before_send: Callable[[], Awaitable[None]] | None = None,
        on_wait: Callable[[], None] | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Gives the hidden states after the last block for the new tokens' input hidden states (with `last_only`,
        for the last token only). On the client's loop, `before_send` is awaited before the step is sent,
        `on_output` runs the moment the output arrives, before this thread wakes up, and `on_wait` once if the step
        backs off (a failover found every server busy, or no server for some blocks)."""
        if on_output is None and before_send is None and on_wait is None:
            return self.client.run(self.remote.step(hidden, last_only=last_only))
        called = time.perf_counter()
        stamps: list[float] = []  # on the loop: when it ran the step, when it sent it, when the output arrived

        async def step_on_loop() -> torch.Tensor:
            stamps.append(time.perf_counter())
            if before_send is not None:
                await before_send()
            stamps.append(time.perf_counter())
            output = await self.remote.step(hidden, last_only=last_only, on_wait=on_wait)
            stamps.append(time.perf_counter())
            if on_output is not None:
                on_output()
            return output

        output = self.client.run(step_on_loop())
        woke = time.perf_counter()
        times, (on_loop, sent, arrived) = self.step_times, stamps
        times.steps += 1
        times.to_loop_ms += (on_loop - called) * 1000
        times.gate_ms += (sent - on_loop) * 1000
        times.swarm_ms += (arrived - sent) * 1000
        times.to_thread_ms += (woke - arrived) * 1000
        return output

    def close(self) -> None:
        self.client.run(self.remote.close())

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
