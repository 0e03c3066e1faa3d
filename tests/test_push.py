"""Server-to-server push: a server forwards its output to the next server of the chain; the client's copy of
the step finds it running or done, and a push that cannot be delivered costs nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import ClientConfig, DistributedModelForCausalLM, SwarmClient
from server.push import Pusher
from swarm.errors import MalformedFrame, StepNotPushed
from swarm.local_swarm import SwarmProcesses
from swarm.model import resolve_model
from swarm.records import NextHop, ServerRecord
from swarm.rpc import RpcConnection
from swarm.wire import MAX_STEPS_PER_FRAME, decode_tensor, encode_tensor
from tests.reference import ReferenceBlocks
from tests.test_swarm_generate import prompt, start_swarm

pytestmark = pytest.mark.slow
HIDDEN = 64
TIMEOUT_S = 30.0


class Span:
    """A raw session on one server, with a local copy of its blocks to check the outputs against."""

    def __init__(self, client: SwarmClient, record: ServerRecord, reference: ReferenceBlocks) -> None:
        self.client, self.record, self.reference = client, record, reference
        self.connection: RpcConnection = client.run(client.connect(record))
        start, end = record.block_start, record.block_end
        self.session_id = self.call("open", {"blocks": [start, end], "max_length": 32})["session_id"]
        self.position = 0

    def call(self, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        return self.client.run(self.connection.call(method, payload, timeout=TIMEOUT_S))

    def hop(self) -> dict[str, Any]:
        return NextHop(peer_id=self.record.peer_id, session_id=self.session_id, addrs=self.record.addrs).to_wire()

    def expected(self, hidden: torch.Tensor) -> torch.Tensor:
        output = self.reference(hidden)
        self.position += hidden.shape[1]
        return output


@pytest.fixture(scope="module")
def swarm(swarm_factory: SwarmProcesses, tiny_llama: Path) -> SwarmProcesses:
    start_swarm(swarm_factory, tiny_llama, ["0:4", "4:8"])
    return swarm_factory


@pytest.fixture(scope="module")
def spans(swarm: SwarmProcesses, tiny_llama: Path) -> Iterator[tuple[Span, Span]]:
    source = resolve_model(str(tiny_llama))
    client = SwarmClient(source.model_id, source.num_blocks, swarm.initial_peers)
    try:
        records = sorted(client.run(client.servers()).values(), key=lambda record: record.block_start)
        first, second = (Span(client, record, ReferenceBlocks(source, record.block_start, record.block_end))
                         for record in records)
        yield first, second
    finally:
        client.shutdown()


def await_pushed_step(span: Span, step_id: str) -> dict[str, Any]:
    """Asks for a step without sending its input: only a push can have brought it (bounded wait)."""
    for _ in range(100):
        try:
            return span.call("step", {"session_id": span.session_id, "step_id": step_id})
        except MalformedFrame as error:  # not pushed yet: the request lacks the hidden states
            assert "hidden" in error.message
            time.sleep(0.05)
    raise AssertionError(f"step {step_id!r} was never pushed to {span.record.peer_id}")


def test_pushed_step_reaches_the_next_server_and_the_clients_copy_finds_it(spans: tuple[Span, Span]) -> None:
    first, second = spans
    hidden = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(0))
    reply = first.call("step", {"session_id": first.session_id, "step_id": "0", "position": 0,
                                "hidden": encode_tensor(hidden), "next": [second.hop()]})
    middle = first.expected(hidden)
    torch.testing.assert_close(decode_tensor(reply["hidden"]), middle, rtol=1e-5, atol=1e-5)

    pushed = await_pushed_step(second, "0")
    torch.testing.assert_close(decode_tensor(pushed["hidden"]), second.expected(middle), rtol=1e-5, atol=1e-5)
    assert pushed["position"] == 5
    # The client's own copy of the step (with its input) is answered from the pushed result, not run twice.
    again = second.call("step", {"session_id": second.session_id, "step_id": "0", "position": 0,
                                 "hidden": encode_tensor(middle)})
    assert again["hidden"] == pushed["hidden"] and again["position"] == 5


def test_undeliverable_or_malformed_route_loses_nothing(spans: tuple[Span, Span], swarm: SwarmProcesses) -> None:
    first, second = spans
    dht_peer = swarm.initial_peers[0].split("/p2p/")[1]  # a peer that serves no chainswarm RPC
    nowhere = NextHop(peer_id=dht_peer, session_id="none", addrs=[]).to_wire()
    with pytest.raises(MalformedFrame):  # a malformed route is refused before anything runs
        first.call("step", {"session_id": first.session_id, "step_id": "x",
                            "hidden": encode_tensor(torch.ones(1, 1, HIDDEN)), "next": [{"peer_id": 5}]})
    for step_id, next_hops in (("1", [nowhere]), ("2", [second.hop()])):
        hidden = torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(int(step_id)))
        position = first.position
        reply = first.call("step", {"session_id": first.session_id, "step_id": step_id, "position": position,
                                    "hidden": encode_tensor(hidden), "next": next_hops})
        middle = first.expected(hidden)
        torch.testing.assert_close(decode_tensor(reply["hidden"]), middle, rtol=1e-5, atol=1e-5)
        # Whether or not the push arrived, the client's copy gives the right output exactly once.
        out = second.call("step", {"session_id": second.session_id, "step_id": step_id, "position": position,
                                   "hidden": encode_tensor(middle)})
        torch.testing.assert_close(decode_tensor(out["hidden"]), second.expected(middle), rtol=1e-5, atol=1e-5)
        assert out["position"] == position + 1


def test_generate_with_and_without_push_matches_local_model(swarm: SwarmProcesses, tiny_llama: Path) -> None:
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    input_ids = prompt(40)
    expected = local.generate(input_ids, max_new_tokens=12, do_sample=False)
    for server_push in (True, False):
        remote = DistributedModelForCausalLM.from_pretrained(
            str(tiny_llama), initial_peers=swarm.initial_peers, client_config=ClientConfig(server_push=server_push)
        )
        try:
            assert remote.generate(input_ids, max_new_tokens=12, do_sample=False).tolist() == expected.tolist()
        finally:
            remote.shutdown()


def test_a_waiting_request_gets_the_pushed_step_or_a_typed_error_in_time(spans: tuple[Span, Span]) -> None:
    first, second = spans
    position = first.position
    hidden = torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(9))

    async def push_and_wait() -> list[dict[str, Any]]:
        # The waiting request goes out first: the second server holds it until the first server's push arrives.
        waiting = asyncio.create_task(second.connection.call(
            "step", {"session_id": second.session_id, "step_id": "w", "position": position, "wait_ms": 20_000},
            timeout=TIMEOUT_S,
        ))
        await asyncio.sleep(0.2)
        pushed_from = await first.connection.call(
            "step", {"session_id": first.session_id, "step_id": "w", "position": position,
                     "hidden": encode_tensor(hidden), "next": [second.hop()]}, timeout=TIMEOUT_S,
        )
        return [pushed_from, await waiting]

    from_first, from_second = first.client.run(push_and_wait())
    middle = first.expected(hidden)
    torch.testing.assert_close(decode_tensor(from_first["hidden"]), middle, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode_tensor(from_second["hidden"]), second.expected(middle), rtol=1e-5, atol=1e-5)

    started = time.monotonic()
    with pytest.raises(StepNotPushed):  # nobody pushes this step: the wait ends at its deadline, nothing changes
        second.call("step", {"session_id": second.session_id, "step_id": "never", "wait_ms": 300})
    assert time.monotonic() - started < TIMEOUT_S
    with pytest.raises(MalformedFrame, match="wait_ms"):
        second.call("step", {"session_id": second.session_id, "step_id": "never", "wait_ms": -1})
    hidden = torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(10))
    reply = second.call("step", {"session_id": second.session_id, "step_id": "after", "position": second.position,
                                 "hidden": encode_tensor(hidden)})
    torch.testing.assert_close(decode_tensor(reply["hidden"]), second.expected(hidden), rtol=1e-5, atol=1e-5)


def test_a_hop_that_does_not_host_the_next_block_gets_no_push(spans: tuple[Span, Span]) -> None:
    first, second = spans
    # A session on the first server that ends at block 2 names a fresh session of the second server (blocks 4:8)
    # as its next hop. The push would be accepted there (same position, valid shape), but the DHT says that server
    # does not host block 2, so the first server must not push to it.
    short = first.call("open", {"blocks": [0, 2], "max_length": 8})["session_id"]
    target = second.call("open", {"blocks": [4, 8], "max_length": 8})["session_id"]
    hop = NextHop(peer_id=second.record.peer_id, session_id=target, addrs=second.record.addrs).to_wire()
    hidden = torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(11))
    try:
        first.call("step", {"session_id": short, "step_id": "misrouted", "position": 0,
                            "hidden": encode_tensor(hidden), "next": [hop]})
        with pytest.raises(StepNotPushed):
            second.call("step", {"session_id": target, "step_id": "misrouted", "wait_ms": 1500})
    finally:
        first.call("close", {"session_id": short})
        second.call("close", {"session_id": target})



def test_a_next_span_on_the_same_server_gets_the_push_in_process(spans: tuple[Span, Span], tiny_llama: Path) -> None:
    """A chain may hold two adjacent spans on one server (a failover put the replacement of a span where its
    neighbour runs). The server cannot dial itself; it hands the push over in process, so the second span's step
    is there for a request that sends no input (before, each such step waited out the client's push wait)."""
    first, _ = spans
    source = resolve_model(str(tiny_llama))
    head, tail = ReferenceBlocks(source, 0, 2), ReferenceBlocks(source, 2, 4)
    lower = first.call("open", {"blocks": [0, 2], "max_length": 8})["session_id"]
    upper = first.call("open", {"blocks": [2, 4], "max_length": 8})["session_id"]
    hop = NextHop(peer_id=first.record.peer_id, session_id=upper, addrs=first.record.addrs, start=2, end=4).to_wire()
    try:
        for position, seed in ((0, 12), (3, 13)):
            hidden = torch.randn(1, 3 if position == 0 else 1, HIDDEN, generator=torch.Generator().manual_seed(seed))
            reply = first.call("step", {"session_id": lower, "step_id": f"{position}", "position": position,
                                        "hidden": encode_tensor(hidden), "next": [hop]})
            middle = head(hidden)
            torch.testing.assert_close(decode_tensor(reply["hidden"]), middle, rtol=1e-5, atol=1e-5)
            pushed = first.call("step", {"session_id": upper, "step_id": f"{position}", "wait_ms": 5_000})
            torch.testing.assert_close(decode_tensor(pushed["hidden"]), tail(middle), rtol=1e-5, atol=1e-5)
            assert pushed["position"] == position + hidden.shape[1]
    finally:
        first.call("close", {"session_id": lower})
        first.call("close", {"session_id": upper})


def recording_pusher(max_frame_bytes: int, frames: list[tuple[str, int, int]]) -> Pusher:
    """Gives a pusher that sends nothing and records each frame it would send: (peer, block, steps)."""
    pusher = Pusher(None, None, timeout_s=1.0, max_frame_bytes=max_frame_bytes)  # type: ignore[arg-type]
    pusher._push_frame = lambda peer, block, payloads: frames.append((peer, block, len(payloads)))  # type: ignore[method-assign]
    return pusher


def test_a_batch_of_pushes_goes_in_frames_per_peer_and_block_within_the_frame_limits() -> None:
    def hops(peer: str) -> list[NextHop]:
        return [NextHop(peer_id=peer, session_id="s", addrs=[])]

    frames: list[tuple[str, int, int]] = []
    step = {"step_id": "0", "hidden": encode_tensor(torch.zeros(1, 1, 4))}
    recording_pusher(64 << 20, frames).push_all(
        [(hops("a"), step, 3)] * (MAX_STEPS_PER_FRAME + 1) + [(hops("a"), step, 5), (hops("b"), step, 3), ([], step, 3)]
    )
    assert frames == [("a", 3, MAX_STEPS_PER_FRAME), ("a", 3, 1), ("a", 5, 1), ("b", 3, 1)]
    frames.clear()
    big = {"step_id": "0", "hidden": encode_tensor(torch.zeros(1, 600, 1024))}  # 2.4 MB each
    recording_pusher(6 << 20, frames).push_all([(hops("a"), big, 3)] * 3)
    assert frames == [("a", 3, 1)] * 3  # half a frame holds one of them
