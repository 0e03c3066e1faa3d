"""Bad input gets a typed error and loses nothing: the server keeps serving, a witness session continues
with correct outputs, and every page returns to the pool."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hivemind.p2p import PeerID

from client import SwarmClient
from swarm.errors import (
    BlocksNotHosted,
    FrameTooLarge,
    InvalidTensor,
    MalformedFrame,
    MaxLengthExceeded,
    PositionMismatch,
    ServerBusy,
    SessionNotFound,
    UnknownMethod,
)
from swarm.local_swarm import SwarmProcesses
from swarm.model import ModelSource, resolve_model
from swarm.records import ServerRecord
from swarm.rpc import PROTOCOL, RpcConnection
from swarm.wire import decode_tensor, encode_tensor, read_frame
from tests.reference import ReferenceBlocks

pytestmark = pytest.mark.slow
HIDDEN = 64
TIMEOUT_S = 30.0


class Peer:
    """A test's raw view of one server: RPC calls and raw frames, plus a local copy of its blocks."""

    def __init__(self, client: SwarmClient, record: ServerRecord, source: ModelSource) -> None:
        self.client, self.record, self.source = client, record, source
        self.connection: RpcConnection = client.run(client.connect(record))

    def call(self, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        return self.client.run(self.connection.call(method, payload, timeout=TIMEOUT_S))

    def info(self) -> ServerRecord:
        record = ServerRecord.from_wire(self.call("info", {})["record"])
        assert record is not None
        return record

    def send_raw(self, frame: bytes) -> dict[str, Any]:
        """Writes `frame` as-is on a fresh stream and gives the decoded reply."""

        async def exchange() -> dict[str, Any]:
            _, reader, writer = await self.client.p2p.call_binary_stream_handler(
                PeerID.from_base58(self.record.peer_id), PROTOCOL
            )
            try:
                writer.write(frame)
                await writer.drain()
                return await read_frame(reader, 1 << 20)
            finally:
                writer.close()

        return self.client.run(exchange(), timeout=TIMEOUT_S)


class Witness:
    """A session opened before any bad input; its outputs must keep matching a local run of the same blocks."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.session_id = peer.call("open", {"blocks": [0, 8], "max_length": 64})["session_id"]
        self.reference = ReferenceBlocks(peer.source, 0, 8)
        self.position = 0
        self.generator = torch.Generator().manual_seed(0)

    def step_and_check(self, tokens: int = 1) -> None:
        hidden = torch.randn(1, tokens, HIDDEN, generator=self.generator)
        reply = self.peer.call("step", {"session_id": self.session_id, "hidden": encode_tensor(hidden)})
        expected = self.reference(hidden)
        self.position += tokens
        torch.testing.assert_close(decode_tensor(reply["hidden"]), expected, rtol=1e-5, atol=1e-5)
        assert reply["position"] == self.position


@pytest.fixture(scope="module")
def peer(swarm_factory: SwarmProcesses, tiny_llama: Path) -> Iterator[Peer]:
    swarm_factory.start_dht()
    swarm_factory.start_server(
        tiny_llama, "0:8", "--max-length", "64", "--memory", "4MB", "--page-size", "64KiB", "--session-timeout", "600"
    )
    source = resolve_model(str(tiny_llama))
    client = SwarmClient(source.model_id, source.num_blocks, swarm_factory.initial_peers)
    try:
        (record,) = client.run(client.servers()).values()
        yield Peer(client, record, source)
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def witness(peer: Peer) -> Witness:
    witness = Witness(peer)
    witness.step_and_check(tokens=5)
    return witness


@pytest.fixture(autouse=True)
def nothing_lost(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each bad input: the witness still computes correctly and only its pages are held."""
    if "peer" not in request.fixturenames:
        yield
        return
    peer: Peer = request.getfixturevalue("peer")
    witness: Witness = request.getfixturevalue("witness")
    kv_pages_before = peer.info().pages_kv
    yield
    witness.step_and_check()
    assert peer.info().pages_kv == kv_pages_before


def session(peer: Peer, max_length: int = 16, blocks: tuple[int, int] = (0, 8)) -> str:
    return peer.call("open", {"blocks": list(blocks), "max_length": max_length})["session_id"]


def test_malformed_frame_gets_typed_error_and_stream_keeps_serving(peer: Peer) -> None:
    garbage = b"\xc1\xc1\xc1 not msgpack"
    reply = peer.send_raw(len(garbage).to_bytes(4, "big") + garbage)
    assert reply["error"]["code"] == MalformedFrame.code
    not_a_request = msgpack.packb({"id": 1, "method": 5}, use_bin_type=True)
    reply = peer.send_raw(len(not_a_request).to_bytes(4, "big") + not_a_request)
    assert reply["error"]["code"] == MalformedFrame.code
    with pytest.raises(UnknownMethod):
        peer.call("no-such-method", {})
    with pytest.raises(MalformedFrame, match="max_length"):
        peer.call("open", {"blocks": [0, 8]})
    with pytest.raises(MalformedFrame, match="wait_id"):
        peer.call("withdraw", {"wait_id": "w" * 129})
    assert peer.call("withdraw", {"wait_id": "never-refused"}) == {"withdrawn": False}


def test_oversized_frame_is_refused_before_reading_it(peer: Peer) -> None:
    reply = peer.send_raw((1 << 31).to_bytes(4, "big") + b"\0" * 64)
    assert reply["error"]["code"] == FrameTooLarge.code
    assert peer.info().state == "online"


def test_wrong_dtype_or_shape_of_hidden_states(peer: Peer) -> None:
    session_id = session(peer)
    bad_inputs = [
        encode_tensor(torch.ones(1, 2, HIDDEN, dtype=torch.int64)),
        encode_tensor(torch.ones(1, 2, HIDDEN + 1)),
        encode_tensor(torch.ones(2, 2, HIDDEN)),
        encode_tensor(torch.ones(1, 0, HIDDEN)),
        encode_tensor(torch.ones(HIDDEN)),
        {"dtype": "float32", "shape": [1, 2, HIDDEN], "data": b"\0" * 12},
        {"dtype": "complex128", "shape": [1, 1, HIDDEN], "data": b"\0" * 16 * HIDDEN},
    ]
    for hidden in bad_inputs:
        with pytest.raises(InvalidTensor):
            peer.call("step", {"session_id": session_id, "hidden": hidden})
    peer.call("step", {"session_id": session_id, "hidden": encode_tensor(torch.ones(1, 2, HIDDEN))})
    peer.call("close", {"session_id": session_id})


def test_step_on_unknown_or_closed_session(peer: Peer) -> None:
    hidden = encode_tensor(torch.ones(1, 1, HIDDEN))
    with pytest.raises(SessionNotFound):
        peer.call("step", {"session_id": "no-such-session", "hidden": hidden})
    session_id = session(peer)
    peer.call("close", {"session_id": session_id})
    with pytest.raises(SessionNotFound):
        peer.call("step", {"session_id": session_id, "hidden": hidden})
    with pytest.raises(SessionNotFound):
        peer.call("close", {"session_id": session_id})


def test_max_length_exceeded_at_open_and_during_steps(peer: Peer) -> None:
    with pytest.raises(MaxLengthExceeded):
        session(peer, max_length=65)  # the server's --max-length is 64
    session_id = session(peer, max_length=8)
    peer.call("step", {"session_id": session_id, "hidden": encode_tensor(torch.ones(1, 6, HIDDEN))})
    with pytest.raises(MaxLengthExceeded):
        peer.call("step", {"session_id": session_id, "hidden": encode_tensor(torch.ones(1, 3, HIDDEN))})
    with pytest.raises(PositionMismatch):
        peer.call("step", {"session_id": session_id, "position": 2, "hidden": encode_tensor(torch.ones(1, 1, HIDDEN))})
    reply = peer.call("step", {"session_id": session_id, "hidden": encode_tensor(torch.ones(1, 2, HIDDEN))})
    assert reply["position"] == 8
    peer.call("close", {"session_id": session_id})


def test_duplicate_step_is_answered_without_advancing(peer: Peer) -> None:
    session_id = session(peer)
    step = {"session_id": session_id, "step_id": "s1", "hidden": encode_tensor(torch.ones(1, 3, HIDDEN))}
    first, again = peer.call("step", step), peer.call("step", step)
    assert first["position"] == again["position"] == 3
    assert first["hidden"] == again["hidden"]
    peer.call("close", {"session_id": session_id})


def test_block_range_not_hosted(peer: Peer) -> None:
    with pytest.raises(BlocksNotHosted):
        session(peer, blocks=(0, 9))
    with pytest.raises(BlocksNotHosted):
        session(peer, blocks=(5, 5))


def test_server_busy_when_pages_run_out_and_pages_return(peer: Peer) -> None:
    opened = []
    with pytest.raises(ServerBusy, match="expected to take"):
        for _ in range(100):
            opened.append(session(peer, max_length=64))
    assert opened, "the pool should hold at least one more session next to the witness"
    record = peer.info()
    assert record.sessions_fit == 0  # refused by the headroom rule, which the record announces
    pages_per_session = 8 * -(-64 * record.kv_bytes_per_token // record.page_bytes)
    assert record.pages_free < pages_per_session  # and for want of pages, not by mistake
    for session_id in opened:
        peer.call("close", {"session_id": session_id})
    assert peer.info().sessions_fit > 0


def test_sessions_of_a_closed_stream_are_freed(peer: Peer) -> None:
    other = Peer(peer.client, peer.record, peer.source)
    other.call("open", {"blocks": [0, 8], "max_length": 32})
    assert peer.info().session_count == 2
    peer.client.run(other.connection.close())
    for _ in range(50):  # the server notices the closed stream asynchronously
        if peer.info().session_count == 1:
            break
        peer.client.run(asyncio.sleep(0.1))
    assert peer.info().session_count == 1


def test_unparseable_blocks_flag_exits_with_a_clear_error(swarm_factory: SwarmProcesses, tiny_llama: Path) -> None:
    for blocks in ("3-5", "0:99"):  # a syntax error, and a range past the model's 8 blocks
        code, output = swarm_factory.run_to_exit(
            ["-m", "server.launch", "--model", str(tiny_llama), "--blocks", blocks, "--host", "127.0.0.1"]
        )
        assert code == 2, output
        assert "block range" in output and blocks in output and "Traceback" not in output


def test_unsupported_architecture_exits_with_a_clear_error(swarm_factory: SwarmProcesses, tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    code, output = swarm_factory.run_to_exit(
        ["-m", "server.launch", "--model", str(tmp_path / "gpt2"), "--blocks", "0:2", "--host", "127.0.0.1"]
    )
    assert code == 2, output
    assert "'gpt2' is not supported" in output and "llama" in output and "Traceback" not in output
