"""A failover that finds no room: a session never waits for room while it holds pages, so sessions that each hold
part of their chain on a full server, and need more of it, cannot wait for one another."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import ClientConfig, DistributedModelForCausalLM, SwarmClient, batched_head
from client.inference import RemoteInferenceSession
from client.routing import Span
from server.sessions import REFUSED_WINDOW_S
from swarm.local_swarm import SwarmProcesses
from swarm.model import resolve_model
from tests.reference import ReferenceBlocks
from tests.test_dropping import POOL, SMALL_SESSIONS
from tests.test_swarm_generate import prompt

pytestmark = pytest.mark.slow
HIDDEN = 64
MAX_LENGTH = 32


def test_sessions_whose_failover_needs_the_room_they_hold_on_a_full_server_let_go_and_end_exact(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    """Two sessions run X[0:4] -> Y[4:8]; two idle sessions fill the rest of X's pages. Y dies, and X is the only
    server left for blocks 4:8, with no page free: each session holds the four pages that the other needs. Waiting
    while holding them, both would wait until `busy_wait_s` ran out. A session that finds X full lets its span there
    go instead, and waits for a chain over all eight blocks, which its saved inputs rebuild; the other then takes
    the pages it freed (or, having found X full too, lets go as well, and the two run one after the other). Both
    give the reference's outputs on chains over X alone, and X's pool ends where it began."""
    swarm_factory.start_dht()
    x = swarm_factory.start_server(tiny_llama, "0:8", *POOL, *SMALL_SESSIONS)
    y = swarm_factory.start_server(tiny_llama, "4:8", *SMALL_SESSIONS)
    source = resolve_model(str(tiny_llama))
    client = SwarmClient(source.model_id, source.num_blocks, swarm_factory.initial_peers,
                         ClientConfig(busy_wait_s=15.0, request_timeout_s=30.0))
    try:
        records = client.run(client.servers())
        on_x, on_y = records[x.peer_id], records[y.peer_id]
        connection = client.run(client.connect(on_x))

        def pages_free() -> int:
            return client.run(connection.call("info", {}, timeout=30.0))["record"]["pages_free"]

        baseline = pages_free()
        sessions = [RemoteInferenceSession(client, max_length=MAX_LENGTH) for _ in range(2)]
        for session in sessions:
            session.spans = [client.run(session.open_span(Span(x.peer_id, 0, 4, on_x))),
                             client.run(session.open_span(Span(y.peer_id, 4, 8, on_y)))]
        fillers = [client.run(connection.call("open", {"blocks": blocks, "max_length": MAX_LENGTH}, timeout=30.0))
                   for blocks in ([0, 8], [0, 4])]
        assert pages_free() == 0, "the scenario needs X full"

        generator = torch.Generator().manual_seed(0)
        references = [ReferenceBlocks(source, 0, 8) for _ in sessions]
        prompts = [torch.randn(1, 5, HIDDEN, generator=generator) for _ in sessions]
        for session, reference, hidden in zip(sessions, references, prompts, strict=True):
            torch.testing.assert_close(client.run(session.step(hidden)), reference(hidden), rtol=1e-4, atol=1e-4)

        swarm_factory.kill(y)
        nexts = [torch.randn(1, 1, HIDDEN, generator=generator) for _ in sessions]

        async def step_and_close(session: RemoteInferenceSession, hidden: torch.Tensor) -> torch.Tensor:
            try:
                return await session.step(hidden)
            finally:
                await session.close()

        async def both() -> list[torch.Tensor]:
            return list(await asyncio.gather(*(step_and_close(s, h) for s, h in zip(sessions, nexts, strict=True))))

        outputs = client.run(both(), timeout=120.0)
        for output, reference, hidden in zip(outputs, references, nexts, strict=True):
            torch.testing.assert_close(output, reference(hidden), rtol=1e-4, atol=1e-4)
        for session in sessions:
            assert [(span.peer_id, span.span.start, span.span.end) for span in session.spans] in (
                [(x.peer_id, 0, 8)], [(x.peer_id, 0, 4), (x.peer_id, 4, 8)])
        assert any(len(session.spans) == 1 for session in sessions), "no session let its span go"

        for filler in fillers:
            client.run(connection.call("close", {"session_id": filler["session_id"]}, timeout=30.0))
        assert pages_free() == baseline
    finally:
        client.shutdown()


def test_a_step_that_waits_for_a_route_does_not_hold_up_its_chains_other_session(
    swarm_factory: SwarmProcesses, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sessions of one client decode on the same chain, whose rows the batched head computes together. One
    loses its server session and waits for a route (its only server is banned), backing off: its step is taken out
    of the head's count (`on_wait`), so the other decodes its tokens meanwhile. Counted still, it would hold every
    pass of the other for up to `MAX_GANG_WAIT_S` (set long here), until the waiting step failed."""
    monkeypatch.setattr(batched_head, "MAX_GANG_WAIT_S", 600.0)
    swarm_factory.start_dht()
    x = swarm_factory.start_server(tiny_llama, "0:8")
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    remote = DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama), initial_peers=swarm_factory.initial_peers,
        client_config=ClientConfig(ban_s=600.0, route_wait_s=10.0, request_timeout_s=30.0))
    client = remote.swarm
    try:
        waiting, going = (remote.inference_session(max_length=MAX_LENGTH) for _ in range(2))
        ids = prompt(0, 6)
        with remote.use_session(waiting):  # both run on the same chain, X[0:8]
            remote(ids)
        connection = client.run(client.connect(client.run(client.servers())[x.peer_id]))
        client.run(connection.call("close", {"session_id": waiting.remote.spans[0].session_id}, timeout=30.0))

        ended: list[str] = []
        errors: list[BaseException] = []

        def step_the_waiting_one() -> None:  # its server session is gone: SessionNotFound, X banned, no route
            try:
                with remote.use_session(waiting):  # it holds the prompt: one more token
                    remote(ids[:, -1:])
            except BaseException as error:  # expected once route_wait_s ran out
                errors.append(error)
            ended.append("waiting")

        def decode_the_other() -> None:  # its prompt, then seven tokens
            with remote.use_session(going):
                going_ids = ids
                for _ in range(8):
                    logits = remote(going_ids).logits
                    going_ids = torch.cat([going_ids, logits[:, -1:].argmax(-1)], dim=1)
            ended.append("going")
            results.append(going_ids)

        results: list[torch.Tensor] = []
        first = threading.Thread(target=step_the_waiting_one, daemon=True)
        first.start()
        for _ in range(200):  # at most 10 s: until it backs off
            if any(attempt.kind == "backoff" for attempt in waiting.remote.open_attempts):
                break
            time.sleep(0.05)
        assert any(attempt.kind == "backoff" for attempt in waiting.remote.open_attempts)
        second = threading.Thread(target=decode_the_other, daemon=True)
        second.start()
        second.join(60.0)
        first.join(60.0)
        assert ended == ["going", "waiting"], "the other session waited for the step that waited for a route"
        assert len(errors) == 1
        expected = local.generate(ids, max_new_tokens=8, do_sample=False)
        assert results[0].tolist() == expected.tolist()
    finally:
        remote.shutdown()


def test_a_wait_that_opens_on_one_server_is_withdrawn_from_the_other_that_refused_it(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    """X and Y both full: a session's wait is refused by both and backs off. Y gets room, the session opens there,
    and X, which refused the same wait, forgets it at once (it would count it in its line, and keep the room it named
    to it, for `REFUSED_WINDOW_S` after its last refusal otherwise)."""
    swarm_factory.start_dht()
    x = swarm_factory.start_server(tiny_llama, "0:8", *POOL, *SMALL_SESSIONS)
    y = swarm_factory.start_server(tiny_llama, "0:8", *POOL, *SMALL_SESSIONS)
    source = resolve_model(str(tiny_llama))
    client = SwarmClient(source.model_id, source.num_blocks, swarm_factory.initial_peers,
                         ClientConfig(busy_wait_s=30.0, request_timeout_s=30.0))
    try:
        records: dict = {}
        deadline = time.monotonic() + 30.0
        while {x.peer_id, y.peer_id} - set(records) and time.monotonic() < deadline:
            records = client.run(client.servers())
        connections = {peer: client.run(client.connect(records[peer])) for peer in (x.peer_id, y.peer_id)}

        def info(peer: str) -> dict:
            return client.run(connections[peer].call("info", {}, timeout=30.0))

        fillers = {peer: [client.run(connection.call("open", {"blocks": [0, 8], "max_length": MAX_LENGTH},
                                                     timeout=30.0)) for _ in range(2)]
                   for peer, connection in connections.items()}
        assert all(info(peer)["record"]["pages_free"] < 8 for peer in connections), "the scenario needs both full"

        session = RemoteInferenceSession(client, max_length=MAX_LENGTH)
        opening = asyncio.run_coroutine_threadsafe(session._open_chain(0, 8), client.background.loop)
        deadline = time.monotonic() + 20.0
        while not all(info(peer)["dropping"]["refused"] for peer in connections) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(info(peer)["dropping"]["refused"] for peer in connections), "both servers refused the wait"

        client.run(connections[y.peer_id].call("close", {"session_id": fillers[y.peer_id][0]["session_id"]},
                                               timeout=30.0))
        spans = opening.result(timeout=30.0)
        assert [span.span.peer_id for span in spans] == [y.peer_id]
        opened_s = time.monotonic()
        while info(x.peer_id)["dropping"]["refused"] and time.monotonic() - opened_s < REFUSED_WINDOW_S / 2:
            time.sleep(0.05)
        assert not info(x.peer_id)["dropping"]["refused"], "X still counts the wait that opened on Y"
        assert not info(y.peer_id)["dropping"]["refused"]
        for span_session in spans:
            client.run(span_session.connection.close())
    finally:
        client.shutdown()
