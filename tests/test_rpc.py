"""RPC over real hivemind p2pd daemons on loopback: calls, typed errors, bad frames, concurrency, lifetimes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P

from swarm.errors import (
    FrameTooLarge,
    InternalServerError,
    MalformedFrame,
    PeerUnreachable,
    RpcTimeout,
    SessionNotFound,
    UnknownMethod,
)
from swarm.rpc import PROTOCOL, CallContext, RpcConnection, RpcServer
from swarm.wire import HEADER_BYTES, StreamClosed, decode_tensor, encode_tensor, pack_frame, read_frame

pytestmark = pytest.mark.timeout(60)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
SCENARIO_TIMEOUT_S = 30.0
WAIT_S = 10.0  # bound for waiting on events that must happen; never a performance threshold

Scenario = Callable[[P2P, P2P], Awaitable[None]]


def run_with_peers(scenario: Scenario) -> None:
    """Runs `scenario(server_p2p, client_p2p)` on two fresh p2pd daemons and always shuts both down."""

    async def main() -> None:
        server_p2p = await P2P.create(host_maddrs=LOOPBACK)
        client_p2p = None
        try:
            client_p2p = await P2P.create(initial_peers=await server_p2p.get_visible_maddrs(), host_maddrs=LOOPBACK)
            await asyncio.wait_for(scenario(server_p2p, client_p2p), SCENARIO_TIMEOUT_S)
        finally:
            if client_p2p is not None:
                await client_p2p.shutdown()
            await server_p2p.shutdown()

    asyncio.run(main())


@asynccontextmanager
async def serving(p2p: P2P, methods: dict[str, Any], **kwargs: Any) -> AsyncIterator[RpcServer]:
    server = RpcServer(p2p, **kwargs)
    for name, fn in methods.items():
        server.add_method(name, fn)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def echo(payload: dict, ctx: CallContext) -> dict:
    return {"payload": payload, "peer_id": ctx.peer_id, "stream_id": ctx.stream_id, "request_bytes": ctx.request_bytes}


async def open_raw_stream(client_p2p: P2P, server_p2p: P2P) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    _, reader, writer = await client_p2p.call_binary_stream_handler(server_p2p.peer_id, PROTOCOL)
    return reader, writer


def test_echo_round_trips_a_tensor_payload_and_reports_the_caller() -> None:
    hidden = torch.randn(1, 4, 8)

    async def double(payload: dict, ctx: CallContext) -> dict:
        return {"hidden": encode_tensor(decode_tensor(payload["hidden"]) * 2)}

    async def scenario(server_p2p: P2P, client_p2p: P2P) -> None:
        async with serving(server_p2p, {"echo": echo, "double": double}):
            connection = await RpcConnection.open(client_p2p, server_p2p.peer_id.to_base58(), timeout=WAIT_S)
            try:
                reply = await connection.call("echo", {"hidden": encode_tensor(hidden)}, timeout=WAIT_S)
                assert torch.equal(decode_tensor(reply["payload"]["hidden"]), hidden)
                assert reply["peer_id"] == str(client_p2p.peer_id)
                assert reply["request_bytes"] > hidden.numel() * 4
                assert connection.last_call_s > 0
                doubled = await connection.call("double", {"hidden": encode_tensor(hidden)}, timeout=WAIT_S)
                assert torch.equal(decode_tensor(doubled["hidden"]), hidden * 2)
            finally:
                await connection.close()
            assert connection.is_closed
            with pytest.raises(PeerUnreachable, match="closed"):
                await connection.call("echo", {}, timeout=WAIT_S)

    run_with_peers(scenario)


def test_typed_errors_cross_the_wire_and_the_stream_keeps_serving() -> None:
    async def lookup(payload: dict, ctx: CallContext) -> dict:
        raise SessionNotFound(f"session {payload['session_id']} is unknown; open a new one")

    async def crash(payload: dict, ctx: CallContext) -> dict:
        raise ValueError("boom")

    async def not_a_map(payload: dict, ctx: CallContext) -> dict:
        return [1, 2]  # type: ignore[return-value]

    async def scenario(server_p2p: P2P, client_p2p: P2P) -> None:
        methods = {"echo": echo, "lookup": lookup, "crash": crash, "not_a_map": not_a_map}
        async with serving(server_p2p, methods):
            connection = await RpcConnection.open(client_p2p, server_p2p.peer_id, timeout=WAIT_S)
            try:
                with pytest.raises(SessionNotFound) as caught:
                    await connection.call("lookup", {"session_id": "abc"}, timeout=WAIT_S)
                assert caught.value.message == "session abc is unknown; open a new one"
                with pytest.raises(InternalServerError, match="ValueError: boom"):
                    await connection.call("crash", {}, timeout=WAIT_S)
                with pytest.raises(InternalServerError, match="returned list"):
                    await connection.call("not_a_map", {}, timeout=WAIT_S)
                with pytest.raises(UnknownMethod, match=r"'nope'.*served: crash, echo, lookup"):
                    await connection.call("nope", {}, timeout=WAIT_S)
                assert (await connection.call("echo", {"x": 1}, timeout=WAIT_S))["payload"] == {"x": 1}
                assert not connection.is_closed
            finally:
                await connection.close()

    run_with_peers(scenario)


def test_malformed_requests_get_malformed_frame_and_the_same_stream_serves_a_valid_call() -> None:
    async def scenario(server_p2p: P2P, client_p2p: P2P) -> None:
        async with serving(server_p2p, {"echo": echo}):
            reader, writer = await open_raw_stream(client_p2p, server_p2p)
            try:
                garbage = b"\xc1\xc1\xc1"
                bad_requests = [
                    (len(garbage).to_bytes(HEADER_BYTES, "big") + garbage, None, "not valid msgpack"),
                    (pack_frame({"id": "seven", "method": "echo", "payload": {}}), None, "id must be an int"),
                    (pack_frame({"id": 3, "method": "echo"}), 3, "map 'payload'"),
                    (pack_frame({"id": 4, "method": 5, "payload": {}}), 4, "str 'method'"),
                ]
                for frame, expected_id, expected_text in bad_requests:
                    writer.write(frame)
                    await writer.drain()
                    reply = await read_frame(reader, max_bytes=2**20)
                    assert reply["id"] == expected_id
                    assert reply["error"]["code"] == MalformedFrame.code
                    assert expected_text in reply["error"]["message"]
                writer.write(pack_frame({"id": 9, "method": "echo", "payload": {"still": "alive"}}))
                await writer.drain()
                reply = await read_frame(reader, max_bytes=2**20)
                assert reply["id"] == 9
                assert reply["ok"]["payload"] == {"still": "alive"}
            finally:
                writer.close()

    run_with_peers(scenario)


def test_oversized_frames_are_refused_and_the_server_keeps_serving_new_streams() -> None:
    async def big_reply(payload: dict, ctx: CallContext) -> dict:
        return {"blob": b"x" * 4096}

    async def scenario(server_p2p: P2P, client_p2p: P2P) -> None:
        async with serving(server_p2p, {"echo": echo, "big_reply": big_reply}, max_frame_bytes=1024):
            reader, writer = await open_raw_stream(client_p2p, server_p2p)
            try:
                writer.write((10**6).to_bytes(HEADER_BYTES, "big") + b"\0" * 100)
                await writer.drain()
                reply = await read_frame(reader, max_bytes=2**20)
                assert reply["id"] is None
                assert reply["error"]["code"] == FrameTooLarge.code
                with pytest.raises(StreamClosed):  # the server gave up the unsynchronisable stream
                    await read_frame(reader, max_bytes=2**20)
            finally:
                writer.close()

            connection = await RpcConnection.open(client_p2p, server_p2p.peer_id, timeout=WAIT_S, max_frame_bytes=1024)
            try:
                # Too large to send: refused locally, and the connection stays usable.
                with pytest.raises(FrameTooLarge):
                    await connection.call("echo", {"blob": b"x" * 2048}, timeout=WAIT_S)
                # Too large to answer: the server sends the error in place of the reply.
                with pytest.raises(FrameTooLarge, match="reply too large"):
                    await connection.call("big_reply", {}, timeout=WAIT_S)
                assert (await connection.call("echo", {"n": 1}, timeout=WAIT_S))["payload"] == {"n": 1}
            finally:
                await connection.close()

    run_with_peers(scenario)


def test_a_slow_call_on_one_connection_does_not_block_a_fast_call_on_another() -> None:
    async def scenario(server_p2p: P2P, client_p2p: P2P) -> None:
        slow_started, release_slow = asyncio.Event(), asyncio.Event()

        async def slow(payload: dict, ctx: CallContext) -> dict:
            slow_started.set()
            await release_slow.wait()
            return {"slow": "done"}

        async with serving(server_p2p, {"echo": echo, "slow": slow}):
            slow_connection = await RpcConnection.open(client_p2p, server_p2p.peer_id, timeout=WAIT_S)
            fast_connection = await RpcConnection.open(client_p2p, server_p2p.peer_id, timeout=WAIT_S)
            try:
                slow_call = asyncio.create_task(slow_connection.call("slow", {}, timeout=WAIT_S))
                await asyncio.wait_for(slow_started.wait(), WAIT_S)
                fast_reply = await fast_connection.call("echo", {"fast": True}, timeout=WAIT_S)
                assert fast_reply["payload"] == {"fast": True}
                assert not slow_call.done()
                release_slow.set()
                assert await slow_call == {"slow": "done"}
            finally:
                release_slow.set()
                await slow_connection.close()
                await fast_connection.close()

    run_with_peers(scenario)


def test_close_callbacks_run_once_when_the_client_closes_the_stream() -> None:
    async def scenario(server_p2p: P2P, client_p2p: P2P) -> None:
        closed_streams: list[tuple[str, int]] = []
        all_closed = asyncio.Event()

        async def open_session(payload: dict, ctx: CallContext) -> dict:
            def release_sync() -> None:
                closed_streams.append(("sync", ctx.stream_id))

            def failing() -> None:
                raise RuntimeError("a failing callback must not stop the others")

            async def release_async() -> None:
                closed_streams.append(("async", ctx.stream_id))
                all_closed.set()

            for callback in (release_sync, failing, release_async):
                ctx.add_close_callback(callback)
            return {"stream_id": ctx.stream_id}

        async with serving(server_p2p, {"open_session": open_session}) as server:
            connection = await RpcConnection.open(client_p2p, server_p2p.peer_id, timeout=WAIT_S)
            stream_id = (await connection.call("open_session", {}, timeout=WAIT_S))["stream_id"]
            assert server.open_streams == 1
            await connection.close()
            await asyncio.wait_for(all_closed.wait(), WAIT_S)
            assert closed_streams == [("sync", stream_id), ("async", stream_id)]
            await asyncio.wait_for(_until(lambda: server.open_streams == 0), WAIT_S)
        assert closed_streams == [("sync", stream_id), ("async", stream_id)]  # stop() did not run them again

    run_with_peers(scenario)


def test_notifications_run_in_order_and_get_no_reply_not_even_an_error() -> None:
    async def scenario(server_p2p: P2P, client_p2p: P2P) -> None:
        received: list[int] = []
        failed = asyncio.Event()

        async def record(payload: dict, ctx: CallContext) -> dict:
            received.append(payload["n"])
            return {"recorded": payload["n"]}

        async def fail(payload: dict, ctx: CallContext) -> dict:
            failed.set()
            raise SessionNotFound("no such session")

        go = asyncio.Event()

        async def wait_for_go(payload: dict, ctx: CallContext) -> dict:
            await go.wait()
            return {}

        methods = {"echo": echo, "record": record, "fail": fail, "wait_for_go": wait_for_go}
        async with serving(server_p2p, methods) as server:
            connection = await RpcConnection.open(client_p2p, server_p2p.peer_id, timeout=WAIT_S)
            try:
                await connection.notify("record", {"n": 1}, timeout=WAIT_S)
                await connection.notify("fail", {}, timeout=WAIT_S)
                await connection.notify("nope", {}, timeout=WAIT_S)
                assert connection.notify_now("record", {"n": 2})  # an idle stream takes it at once
                waiting = asyncio.create_task(connection.call("wait_for_go", {}, timeout=WAIT_S))
                await asyncio.sleep(0)
                assert not connection.notify_now("record", {"n": 99})  # a call holds the stream: not sent
                go.set()
                await waiting
                # Had any notification been answered, this call would read that answer instead of its own.
                reply = await connection.call("echo", {"x": 3}, timeout=WAIT_S)
                assert reply["payload"] == {"x": 3}
                assert received == [1, 2] and failed.is_set()
                with pytest.raises(FrameTooLarge):
                    await connection.notify("record", {"n": b"x" * (server.max_frame_bytes + 1)}, timeout=WAIT_S)
                assert (await connection.call("echo", {"x": 4}, timeout=WAIT_S))["payload"] == {"x": 4}
            finally:
                await connection.close()
            with pytest.raises(PeerUnreachable, match="closed"):
                await connection.notify("record", {"n": 5}, timeout=WAIT_S)

            # A stream the server ended is noticed by the next notification, not written into forever. Which sign
            # comes first is a race: the stream's end read, the transport closing, or a write that found it gone.
            connection = await RpcConnection.open(client_p2p, server_p2p.peer_id, timeout=WAIT_S)
            await connection.call("echo", {}, timeout=WAIT_S)
            await server.stop()
            with pytest.raises(PeerUnreachable, match=r"ended|lost|closing"):
                for _ in range(int(WAIT_S / 0.01)):
                    await connection.notify("record", {"n": 6}, timeout=WAIT_S)
                    await asyncio.sleep(0.01)
            assert received == [1, 2]

    run_with_peers(scenario)


def test_rpc_timeout_or_cancel_breaks_the_connection_and_cancels_the_hung_handler() -> None:
    async def scenario(server_p2p: P2P, client_p2p: P2P) -> None:
        in_handler, handler_cancelled, stream_released = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def hang(payload: dict, ctx: CallContext) -> dict:
            ctx.add_close_callback(stream_released.set)
            in_handler.set()
            try:
                await asyncio.Event().wait()
            finally:
                handler_cancelled.set()
            return {}

        async with serving(server_p2p, {"hang": hang}):
            connection = await RpcConnection.open(client_p2p, server_p2p.peer_id, timeout=WAIT_S)
            try:
                with pytest.raises(RpcTimeout, match="'hang'"):
                    await connection.call("hang", {}, timeout=0.5)
                assert connection.is_closed
                with pytest.raises(PeerUnreachable, match="timed out"):
                    await connection.call("hang", {}, timeout=WAIT_S)
                await asyncio.wait_for(handler_cancelled.wait(), WAIT_S)
                await asyncio.wait_for(stream_released.wait(), WAIT_S)
            finally:
                await connection.close()

            # A call cancelled by its caller after sending gives the connection up for the same reason.
            in_handler.clear()
            handler_cancelled.clear()
            connection = await RpcConnection.open(client_p2p, server_p2p.peer_id, timeout=WAIT_S)
            try:
                call = asyncio.create_task(connection.call("hang", {}, timeout=WAIT_S))
                await asyncio.wait_for(in_handler.wait(), WAIT_S)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                assert connection.is_closed
                await asyncio.wait_for(handler_cancelled.wait(), WAIT_S)
            finally:
                await connection.close()

    run_with_peers(scenario)


def test_server_stop_ends_open_streams_and_unreachable_peers_are_reported() -> None:
    async def scenario(server_p2p: P2P, client_p2p: P2P) -> None:
        in_handler, stream_released = asyncio.Event(), asyncio.Event()

        async def hang(payload: dict, ctx: CallContext) -> dict:
            ctx.add_close_callback(stream_released.set)
            in_handler.set()
            await asyncio.Event().wait()
            return {}

        server = RpcServer(server_p2p)
        server.add_method("hang", hang)
        await server.start()
        connection = await RpcConnection.open(client_p2p, server_p2p.peer_id, timeout=WAIT_S)
        try:
            call = asyncio.create_task(connection.call("hang", {}, timeout=WAIT_S))
            await asyncio.wait_for(in_handler.wait(), WAIT_S)
            await server.stop()
            assert stream_released.is_set()
            with pytest.raises(PeerUnreachable, match="lost"):
                await call
        finally:
            await connection.close()
            await server.stop()

        # The protocol is no longer served, the id is garbage, or the peer does not exist at all. While the client's
        # peerstore still lists the protocol (the server's identify push may not have arrived yet), libp2p opens the
        # stream lazily and the refusal shows at the first call instead of at the open: either is PeerUnreachable.
        with pytest.raises(PeerUnreachable):
            late = await RpcConnection.open(client_p2p, server_p2p.peer_id, timeout=WAIT_S)
            try:
                await late.call("hang", {}, timeout=WAIT_S)
            finally:
                await late.close()
        with pytest.raises(PeerUnreachable, match="not a valid peer id"):
            await RpcConnection.open(client_p2p, "not-a-peer-id", timeout=WAIT_S)
        with pytest.raises(PeerUnreachable):
            await RpcConnection.open(client_p2p, "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN", timeout=1.0)

    run_with_peers(scenario)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)
