"""Server-to-server push: a step's output goes straight to the next server of the chain, as in Petals.

The client still sends every server its step (and keeps every input for replay), so a push is only a head
start: the next server begins computing one network leg earlier, and the client's own copy of the step finds
the work running or done (same step id). A failed push costs nothing but that head start, so failures are
logged, never raised. Pushes are RPC notifications: the next server answers nothing, so no acknowledgement
crosses the link (and wakes both servers) while the next server starts its step.

Clients name the next hops, so a server only dials a peer that the DHT says hosts the block where the hop
begins, at the addresses it announced there; the addresses a client sends are not used. A next hop on this server
itself (a client's failover put two adjacent spans of its chain here) is handed over in process: a server cannot
dial itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm.errors import PeerUnreachable, SwarmError
from swarm.records import NextHop
from swarm.rpc import RpcConnection
from swarm.wire import MAX_STEPS_PER_FRAME

log = logging.getLogger(__name__)


MAX_PEERS = 32  # open streams kept to next servers; the least recently used one closes beyond this
MAX_IN_FLIGHT = 64  # pushes being sent at once; more are dropped (the client sends every step itself anyway)
DIAL_BACKOFF_S = 10.0  # after a failed dial, pushes to that peer are dropped for this long
MAX_FAILED_PEERS = 256
VERIFIED_TTL_S = 30.0  # how long a DHT answer "peer P hosts block B at these addresses" is trusted
MAX_VERIFIED = 256


class Pusher:
    """Owns this server's streams to next servers (one per peer) and the tasks that push on them.

    Next hops come from clients, so everything they can make this server hold is bounded: streams (LRU), pushes in
    flight, dials (one per peer at a time; a push meets a dial in progress or a recent failure and is dropped),
    and DHT answers on which peer hosts which block (LRU).
    """

    def __init__(
        self,
        p2p: P2P,
        announced_addrs: Callable[[str, int], Awaitable[list[str] | None]],
        *,
        timeout_s: float,
        max_frame_bytes: int,
        own_peer_id: str | None = None,
        push_here: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """`announced_addrs(peer_id, block)` gives the addresses `peer_id` announced for `block`, None if it did
        not announce that block; `push_here(frame)` takes a push frame bound for `own_peer_id`, this server."""
        self.p2p = p2p
        self.own_peer_id = own_peer_id
        self.push_here = push_here
        self.announced_addrs = announced_addrs
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._connections: OrderedDict[str, RpcConnection] = OrderedDict()
        self._dialing: set[str] = set()
        self._failed_at: OrderedDict[str, float] = OrderedDict()
        self._verified: OrderedDict[tuple[str, int], tuple[float, list[str]]] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0  # steps handed to a stream to the next server
        self.dropped = 0  # steps not sent: backoff after a failed dial, too many in flight, or a failed send

    def push(self, hops: list[NextHop], step: dict[str, Any], *, block: int) -> None:
        """Starts sending `step` (a `push` payload without session and route) to hops[0], which starts at `block`,
        handing on hops[1:]."""
        self.push_all([(hops, step, block)])

    def push_all(self, pushes: list[tuple[list[NextHop], dict[str, Any], int]]) -> None:
        """Starts sending each (hops, step, block) as `push` does; steps bound for the same peer and block go in
        one frame (as many as fit in half a frame, and at most MAX_STEPS_PER_FRAME), so that they arrive, and
        compute, together."""
        groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
        sizes: dict[tuple[str, int], int] = {}
        for hops, step, block in pushes:
            if not hops:
                continue
            first, rest = hops[0], hops[1:]
            payload = {**step, "session_id": first.session_id, "next": [hop.to_wire() for hop in rest]}
            if first.start is not None and first.end is not None:
                payload["blocks"] = [first.start, first.end]
            key = (first.peer_id, block)
            nbytes = len(step.get("hidden", {}).get("data", b""))
            group = groups.setdefault(key, [])
            if group and (sizes[key] + nbytes > self.max_frame_bytes // 2 or len(group) >= MAX_STEPS_PER_FRAME):
                self._push_frame(*key, group)
                group = groups[key] = []
                sizes[key] = 0
            group.append(payload)
            sizes[key] = sizes.get(key, 0) + nbytes
        for (peer_id, block), payloads in groups.items():
            self._push_frame(peer_id, block, payloads)

    def _push_frame(self, peer_id: str, block: int, payloads: list[dict[str, Any]]) -> None:
        frame = payloads[0] if len(payloads) == 1 else {"steps": payloads}
        if peer_id == self.own_peer_id and self.push_here is not None:
            # after the batch that finished these steps, as a frame from another server would come
            asyncio.get_running_loop().call_soon(self.push_here, frame)
            self.sent += len(payloads)
            return
        failed_at = self._failed_at.get(peer_id)
        if failed_at is not None and time.monotonic() - failed_at < DIAL_BACKOFF_S:
            self.dropped += len(payloads)
            return
        if len(self._tasks) >= MAX_IN_FLIGHT or peer_id in self._dialing:
            log.debug("push to %s dropped (%d in flight)", peer_id, len(self._tasks))
            self.dropped += len(payloads)
            return
        if self._send_now(peer_id, block, frame, len(payloads)):
            return
        task = asyncio.create_task(self._send(peer_id, block, frame, len(payloads)), name=f"push-{peer_id[-8:]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send_now(self, peer_id: str, block: int, payload: dict[str, Any], steps: int) -> bool:
        """Writes the push at once on an open stream to a peer recently confirmed to host `block`, sparing the task
        hop of `_send`; gives whether the push is done with (sent or failed)."""
        connection = self._connections.get(peer_id)
        known = self._verified.get((peer_id, block))
        if connection is None or known is None or time.monotonic() - known[0] >= VERIFIED_TTL_S:
            return False
        try:
            if not connection.notify_now("push", payload):
                return False
        except SwarmError as error:
            log.debug("push to %s failed: %s: %s", peer_id, type(error).__name__, error.message)
            self.dropped += steps
            if connection.is_closed:
                self._connections.pop(peer_id, None)
            return True
        self.sent += steps
        self._connections.move_to_end(peer_id)
        return True

    async def _send(self, peer_id: str, block: int, payload: dict[str, Any], steps: int) -> None:
        try:
            connection = await self._connection(peer_id, block)
            await connection.notify("push", payload, timeout=self.timeout_s)
            self.sent += steps
        except SwarmError as error:  # e.g. the next server is gone; what it refuses, it logs itself
            self.dropped += steps
            log.debug("push to %s failed: %s: %s", peer_id, type(error).__name__, error.message)
            dropped = self._connections.get(peer_id)
            if dropped is not None and dropped.is_closed:
                self._connections.pop(peer_id, None)

    async def _connection(self, peer_id: str, block: int) -> RpcConnection:
        """Gives an open stream to `peer_id` once the DHT confirms it hosts `block`, dialing the addresses it
        announced there the first time."""
        addrs = await self._announced(peer_id, block)
        connection = self._connections.get(peer_id)
        if connection is not None and not connection.is_closed:
            self._connections.move_to_end(peer_id)
            return connection
        if peer_id in self._dialing:
            raise PeerUnreachable(f"a dial to {peer_id} is in progress; this push is dropped")
        self._dialing.add(peer_id)
        try:
            try:
                peer = PeerID.from_base58(peer_id)
                multiaddrs = [Multiaddr(addr.split("/p2p/")[0]) for addr in addrs]
                await asyncio.wait_for(self.p2p._client.connect(peer, multiaddrs), self.timeout_s)
            except Exception as error:  # an unusable announced address, or a dead peer
                log.debug("cannot dial %s for a push: %s: %s", peer_id, type(error).__name__, error)
            try:
                connection = await RpcConnection.open(
                    self.p2p, peer_id, timeout=self.timeout_s, max_frame_bytes=self.max_frame_bytes
                )
            except SwarmError:
                self._note_failure(peer_id)
                raise
        finally:
            self._dialing.discard(peer_id)
        self._failed_at.pop(peer_id, None)
        self._connections[peer_id] = connection
        while len(self._connections) > MAX_PEERS:
            _, evicted = self._connections.popitem(last=False)
            self._close_later(evicted)
        return connection

    async def _announced(self, peer_id: str, block: int) -> list[str]:
        """Gives the addresses `peer_id` announced for `block` (looked up at most every VERIFIED_TTL_S), or raises
        PeerUnreachable if it does not host that block."""
        known = self._verified.get((peer_id, block))
        if known is not None and time.monotonic() - known[0] < VERIFIED_TTL_S:
            return known[1]
        addrs = await self.announced_addrs(peer_id, block)
        if addrs is None:
            self._note_failure(peer_id)
            raise PeerUnreachable(f"{peer_id} has not announced block {block}; no push to it")
        self._verified[peer_id, block] = (time.monotonic(), addrs)
        self._verified.move_to_end((peer_id, block))
        while len(self._verified) > MAX_VERIFIED:
            self._verified.popitem(last=False)
        return addrs

    def _note_failure(self, peer_id: str) -> None:
        self._failed_at[peer_id] = time.monotonic()
        self._failed_at.move_to_end(peer_id)
        while len(self._failed_at) > MAX_FAILED_PEERS:
            self._failed_at.popitem(last=False)

    def _close_later(self, connection: RpcConnection) -> None:
        task = asyncio.create_task(connection.close())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancels pending pushes and closes every stream."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for connection in self._connections.values():
            await connection.close()
        self._connections.clear()
