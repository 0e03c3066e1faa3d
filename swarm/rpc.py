"""Request/response calls between peers over hivemind's libp2p streams, one frame per request and per reply.

Request: ``{"id": int, "method": str, "payload": map}``.
Reply: ``{"id": int, "ok": map}`` or ``{"id": int | None, "error": {"code": str, "message": str}}``.
Notification: a request with ``"notify": true`` gets no reply at all, not even an error (the server logs it), so the
sender's stream carries nothing back and neither side wakes up for an acknowledgement.
A stream carries any number of calls and notifications, handled in order; each stream is served by its own
coroutine.
A peer ends a stream by closing it (there is no half-close): the server then cancels the request it is
handling and runs the stream's close callbacks, which is how sessions die with their stream.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm.errors import (
    FrameTooLarge,
    InternalServerError,
    MalformedFrame,
    PeerUnreachable,
    RpcTimeout,
    SwarmError,
    UnknownMethod,
)
from swarm.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_BYTES,
    StreamClosed,
    pack_frame,
    read_frame,
    read_frame_body,
    read_frame_header,
    unpack_body,
)

PROTOCOL = "/chainswarm/rpc/1.0.0"
STOP_TIMEOUT_S = 5.0

logger = logging.getLogger(__name__)

CloseCallback = Callable[[], object]  # may return an awaitable


class CallContext:
    """What a method handler knows about the stream a request came on."""

    def __init__(self, peer_id: str, stream_id: int) -> None:
        self.peer_id = peer_id
        self.stream_id = stream_id
        # Receive statistics of the latest request frame, for estimating inbound throughput.
        self.request_bytes = 0
        self.request_read_s = 0.0
        self._close_callbacks: list[CloseCallback] = []
        self._closed = False

    def add_close_callback(self, callback: CloseCallback) -> None:
        """Registers `callback` (sync or async, no arguments) to run once when the stream ends for any reason."""
        if self._closed:
            raise RuntimeError(f"stream {self.stream_id} from {self.peer_id} is already closed")
        self._close_callbacks.append(callback)

    async def _run_close_callbacks(self) -> None:
        """Runs every close callback once; their failures are logged so that one cannot skip the others."""
        self._closed = True
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            try:
                result = callback()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                logger.exception(f"close callback {callback!r} of stream {self.stream_id} failed")


Handler = Callable[[dict[str, Any], CallContext], Awaitable[dict[str, Any]]]


def _error_reply(request_id: int | None, error: SwarmError) -> dict[str, Any]:
    return {"id": request_id, "error": error.to_wire()}


class RpcServer:
    """Serves registered methods on every stream peers open to `protocol` on this P2P instance."""

    def __init__(self, p2p: P2P, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, protocol: str = PROTOCOL) -> None:
        self.p2p = p2p
        self.max_frame_bytes = max_frame_bytes
        self.protocol = protocol
        self._methods: dict[str, Handler] = {}
        self._streams: dict[int, tuple[asyncio.Task, asyncio.Task]] = {}  # coroutine, its serving task
        self._stream_ids = itertools.count()
        self._started = False

    def add_method(self, name: str, fn: Handler) -> None:
        """Serves `fn(payload, ctx) -> dict` as method `name`."""
        if name in self._methods:
            raise ValueError(f"method {name!r} is already registered")
        self._methods[name] = fn

    @property
    def open_streams(self) -> int:
        """Gives how many streams are being served right now."""
        return len(self._streams)

    async def start(self) -> None:
        """Starts accepting streams."""
        await self.p2p.add_binary_stream_handler(self.protocol, self._serve_stream)
        self._started = True

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stops accepting streams, cancels the open ones and waits (at most `timeout`) for their cleanup."""
        if self._started:
            self._started = False
            # The daemon may already be gone at shutdown; there is nothing left to unregister then.
            with suppress(Exception):
                await asyncio.wait_for(self.p2p.remove_binary_stream_handler(self.protocol), timeout)
        streams = list(self._streams.values())
        for _, serving in streams:
            serving.cancel()
        if streams:
            # Waiting for the stream coroutines, not just their serving tasks, covers the close callbacks.
            await asyncio.wait([stream for stream, _ in streams], timeout=timeout)

    async def _serve_stream(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answers the requests of one stream in order until it closes, then runs its close callbacks."""
        ctx = CallContext(peer_id=str(stream_info.peer_id), stream_id=next(self._stream_ids))
        serving = asyncio.create_task(self._serve_requests(reader, writer, ctx))
        current = asyncio.current_task()
        assert current is not None
        self._streams[ctx.stream_id] = (current, serving)
        try:
            # stop() cancels `serving`, not this task: asyncio's stream server logs a callback task that ends
            # cancelled as an unhandled error.
            await asyncio.wait((serving,))
            error = None if serving.cancelled() else serving.exception()
            if error is not None and not isinstance(error, (StreamClosed, ConnectionError)):
                logger.error(f"stream {ctx.stream_id} from {ctx.peer_id} failed", exc_info=error)
        finally:
            if not serving.done():  # this task itself was cancelled (event loop shutdown)
                serving.cancel()
                with suppress(asyncio.CancelledError):
                    await serving
            self._streams.pop(ctx.stream_id, None)
            writer.close()
            await ctx._run_close_callbacks()

    async def _serve_requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ctx: CallContext
    ) -> None:
        # The next header is read while a request is handled, so that a peer closing the stream cancels the
        # handler (and frees its sessions) at once instead of when the handler happens to finish.
        next_header: asyncio.Task[int] | None = None
        handling: asyncio.Task[dict[str, Any]] | None = None
        try:
            while True:
                if next_header is None:
                    next_header = asyncio.create_task(read_frame_header(reader, self.max_frame_bytes))
                try:
                    body_bytes = await next_header
                except FrameTooLarge as e:
                    # The oversized body is not read, so the stream cannot be resynchronised: answer and close.
                    await self._write_reply(writer, _error_reply(None, e))
                    return
                next_header = None
                header_done = time.perf_counter()
                body = await read_frame_body(reader, body_bytes)
                ctx.request_bytes = HEADER_BYTES + body_bytes
                ctx.request_read_s = time.perf_counter() - header_done

                handling = asyncio.create_task(self._answer(body, ctx))
                next_header = asyncio.create_task(read_frame_header(reader, self.max_frame_bytes))
                await asyncio.wait((handling, next_header), return_when=asyncio.FIRST_COMPLETED)
                if not handling.done() and isinstance(next_header.exception(), StreamClosed):
                    return  # finally cancels the handler
                reply = await handling
                handling = None
                if reply is not None:  # None: a notification
                    await self._write_reply(writer, reply)
        finally:
            for task in (handling, next_header):
                if task is not None:
                    task.cancel()  # a no-op when done; awaiting still collects its exception so none goes unread
                    with suppress(asyncio.CancelledError, Exception):
                        await task

    async def _answer(self, body: bytes, ctx: CallContext) -> dict[str, Any] | None:
        """Gives the reply frame to one request body (every failure becomes a typed error reply), or None for a
        notification, whose failures are only logged."""
        try:
            request = unpack_body(body)
        except MalformedFrame as e:
            return _error_reply(None, e)
        if request.get("notify") is True:
            reply = await self._answer_request(request, ctx)
            if "error" in reply:
                logger.debug(f"notification {request.get('method')!r:.50} from {ctx.peer_id} failed: {reply['error']}")
            return None
        return await self._answer_request(request, ctx)

    async def _answer_request(self, request: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        request_id = request.get("id")
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            return _error_reply(None, MalformedFrame(f"request id must be an int, got {request_id!r:.50}"))
        method, payload = request.get("method"), request.get("payload")
        if not isinstance(method, str) or not isinstance(payload, dict):
            return _error_reply(
                request_id,
                MalformedFrame(
                    f"a request needs a str 'method' and a map 'payload'; got method {type(method).__name__} "
                    f"and payload {type(payload).__name__}"
                ),
            )
        fn = self._methods.get(method)
        if fn is None:
            served = ", ".join(sorted(self._methods)) or "none"
            return _error_reply(request_id, UnknownMethod(f"method {method!r} is not served here; served: {served}"))
        try:
            result = await fn(payload, ctx)
        except SwarmError as e:
            return _error_reply(request_id, e)
        except Exception as e:
            logger.exception(f"method {method!r} failed for {ctx.peer_id}")
            return _error_reply(request_id, InternalServerError(f"{type(e).__name__}: {e}"))
        if not isinstance(result, dict):
            error = InternalServerError(f"method {method!r} returned {type(result).__name__}, not a map")
            return _error_reply(request_id, error)
        return {"id": request_id, "ok": result}

    async def _write_reply(self, writer: asyncio.StreamWriter, reply: dict[str, Any]) -> None:
        """Sends `reply`; one that cannot be packed or is too large goes out as an error in its place."""
        try:
            frame = pack_frame(reply, max_bytes=self.max_frame_bytes)
        except FrameTooLarge as e:
            frame = pack_frame(_error_reply(reply.get("id"), FrameTooLarge(f"reply too large: {e.message}")))
        except Exception as e:
            logger.exception("could not pack a reply")
            frame = pack_frame(_error_reply(reply.get("id"), InternalServerError(f"{type(e).__name__}: {e}")))
        writer.write(frame)
        await writer.drain()


async def dial(
    p2p: P2P, peer_id: str, addrs: list[str], *, timeout: float, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> RpcConnection:
    """Gives a new RPC stream to `peer_id`, dialing its announced addresses (`.../p2p/<peer id>`) first."""
    try:
        # the daemon's connect wants transport addresses; the announced ones end in /p2p/<peer id>
        transport = [Multiaddr(addr.split("/p2p/")[0]) for addr in addrs]
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id), transport), timeout)
    except Exception as error:
        raise PeerUnreachable(f"cannot dial {peer_id}: {type(error).__name__}: {error}") from error
    return await RpcConnection.open(p2p, peer_id, timeout=timeout, max_frame_bytes=max_frame_bytes)


class RpcConnection:
    """One stream to a peer's RpcServer; calls on it are serialized and answered in order."""

    def __init__(
        self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame_bytes: int
    ) -> None:
        self.peer_id = peer_id
        self.max_frame_bytes = max_frame_bytes
        self.last_call_s = 0.0  # request sent to reply read, of the latest call that got a reply or failed
        self._reader, self._writer = reader, writer
        self._lock = asyncio.Lock()
        self._request_ids = itertools.count()
        self._unusable: str | None = None  # why no further call can be made

    @classmethod
    async def open(
        cls,
        p2p: P2P,
        peer_id: PeerID | str,
        *,
        timeout: float,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        protocol: str = PROTOCOL,
    ) -> RpcConnection:
        """Gives a connection on a new stream to `peer_id`; raises PeerUnreachable on failure or timeout."""
        try:
            peer = peer_id if isinstance(peer_id, PeerID) else PeerID.from_base58(peer_id)
        except Exception as e:
            raise PeerUnreachable(f"{peer_id!r:.80} is not a valid peer id ({type(e).__name__}: {e})") from e
        try:
            _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, protocol), timeout)
        except TimeoutError:
            raise PeerUnreachable(f"could not open a stream to {peer} within {timeout} s") from None
        except Exception as e:
            raise PeerUnreachable(f"could not open a stream to {peer}: {type(e).__name__}: {e}") from e
        return cls(str(peer), reader, writer, max_frame_bytes)

    @property
    def is_closed(self) -> bool:
        """Gives whether the connection was closed or broken (every further call raises PeerUnreachable)."""
        return self._unusable is not None

    async def call(self, method: str, payload: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """Gives the `ok` map the peer answered to `method(payload)`.

        Raises the typed error the peer sent; RpcTimeout if no reply came within `timeout` (the time spent
        waiting behind other calls counts; a call that timed out or was cancelled after sending breaks the
        connection);
        PeerUnreachable if the stream is closed, broken or dies; FrameTooLarge for a request over the limit.
        """
        try:
            async with asyncio.timeout(timeout), self._lock:
                if self._unusable is not None:
                    raise PeerUnreachable(f"connection to {self.peer_id} is unusable: {self._unusable}")
                request_id = next(self._request_ids)
                frame = pack_frame(
                    {"id": request_id, "method": method, "payload": payload}, max_bytes=self.max_frame_bytes
                )
                started = time.perf_counter()
                try:
                    self._writer.write(frame)
                    await self._writer.drain()
                    reply = await read_frame(self._reader, self.max_frame_bytes)
                except (StreamClosed, ConnectionError) as e:
                    self._break(f"stream lost during {method!r}")
                    raise PeerUnreachable(f"stream to {self.peer_id} lost during {method!r}: {e}") from e
                except SwarmError as e:  # an unreadable reply: the stream can no longer be trusted
                    self._break(f"unreadable reply to {method!r}: {e.message}")
                    raise
                except asyncio.CancelledError:
                    # A late reply would be taken for the next call's, so the stream is given up.
                    self._break(f"{method!r} timed out or was cancelled before its reply")
                    raise
                finally:
                    self.last_call_s = time.perf_counter() - started
                return self._unwrap(reply, request_id, method)
        except TimeoutError:
            raise RpcTimeout(f"{self.peer_id} did not answer {method!r} within {timeout} s") from None

    async def notify(self, method: str, payload: dict[str, Any], *, timeout: float) -> None:
        """Sends `method(payload)` as a notification: the peer runs it and answers nothing, not even an error.

        Returns once the frame is handed to the transport. Raises PeerUnreachable if the stream is closed or the
        peer has ended it (seen on the next notification), RpcTimeout if the frame could not be sent within
        `timeout`, FrameTooLarge for a request over the limit.
        """
        try:
            async with asyncio.timeout(timeout), self._lock:
                frame = self._notification_frame(method, payload)
                try:
                    self._writer.write(frame)
                    await self._writer.drain()
                except ConnectionError as e:
                    self._break(f"stream lost during notification {method!r}")
                    raise PeerUnreachable(f"stream to {self.peer_id} lost during {method!r}: {e}") from e
                except asyncio.CancelledError:  # part of a frame may be out: the stream is out of sync
                    self._break(f"notification {method!r} timed out or was cancelled while sending")
                    raise
        except TimeoutError:
            raise RpcTimeout(f"could not send {method!r} to {self.peer_id} within {timeout} s") from None

    def notify_now(self, method: str, payload: dict[str, Any]) -> bool:
        """Sends a notification without waiting if no call holds the stream and its transport has nothing queued;
        gives whether it did (if not, `notify` waits its turn). Raises like `notify`."""
        if self._lock.locked() or self._writer.transport.get_write_buffer_size() > 0:
            return False
        self._writer.write(self._notification_frame(method, payload))
        return True

    def _notification_frame(self, method: str, payload: dict[str, Any]) -> bytes:
        """Gives the frame of a notification; raises PeerUnreachable if the stream cannot carry one."""
        if self._reader.at_eof():  # the peer ended the stream, e.g. after refusing an oversized frame
            self._break("the peer ended the stream")
        if self._unusable is None and self._writer.transport.is_closing():
            self._break("the transport is closing")
        if self._unusable is not None:
            raise PeerUnreachable(f"connection to {self.peer_id} is unusable: {self._unusable}")
        message = {"id": next(self._request_ids), "method": method, "payload": payload, "notify": True}
        return pack_frame(message, max_bytes=self.max_frame_bytes)

    def _unwrap(self, reply: dict[str, Any], request_id: int, method: str) -> dict[str, Any]:
        """Gives the reply's `ok` map or raises the error it carries."""
        reply_id = reply.get("id")
        if "error" in reply and reply_id in (request_id, None):
            error = SwarmError.from_wire(reply["error"])
            if reply_id is None and isinstance(error, FrameTooLarge):
                self._break(f"peer refused a frame and closed the stream: {error.message}")
            raise error
        ok = reply.get("ok")
        if reply_id != request_id or not isinstance(ok, dict):
            self._break(f"unexpected reply to {method!r}")
            raise MalformedFrame(
                f"reply to {method!r} (id {request_id}) is not a matching ok/error map: {reply!r:.200}"
            )
        return ok

    def _break(self, reason: str) -> None:
        """Marks the connection unusable and closes the stream, which also cancels the peer's handler."""
        if self._unusable is None:
            self._unusable = reason
        self._writer.close()

    async def close(self) -> None:
        """Closes the stream; the peer's close callbacks for it run once it sees the end."""
        self._break("closed")
        with suppress(Exception):
            await asyncio.wait_for(self._writer.wait_closed(), STOP_TIMEOUT_S)

    async def __aenter__(self) -> RpcConnection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
