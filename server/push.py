"""Server-to-server push: a step's output goes straight to the next server of the chain, as in Petals.

The client still sends every server its step (and keeps every input for replay), so a push is only a head
start: the next server begins computing one network leg earlier, and the client's own copy of the step finds
the work running or done (same step id). A failed push costs nothing but that head start, so failures are
logged, never raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm.errors import PeerUnreachable, SwarmError
from swarm.records import NextHop
from swarm.rpc import RpcConnection

log = logging.getLogger(__name__)


MAX_PEERS = 32  # open streams kept to next servers; the least recently used one closes beyond this
MAX_IN_FLIGHT = 64  # pushes being sent at once; more are dropped (the client sends every step itself anyway)
DIAL_BACKOFF_S = 10.0  # after a failed dial, pushes to that peer are dropped for this long
MAX_FAILED_PEERS = 256


class Pusher:
    """Owns this server's streams to next servers (one per peer) and the tasks that push on them.

    Next hops come from clients, so everything they can make this server hold is bounded: streams (LRU), pushes in
    flight, dials (one per peer at a time; a push meets a dial in progress or a recent failure and is dropped).
    """

    def __init__(self, p2p: P2P, *, timeout_s: float, max_frame_bytes: int) -> None:
        self.p2p = p2p
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._connections: OrderedDict[str, RpcConnection] = OrderedDict()
        self._dialing: set[str] = set()
        self._failed_at: OrderedDict[str, float] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def push(self, hops: list[NextHop], step: dict[str, Any]) -> None:
        """Starts sending `step` (a `push` payload without session and route) to hops[0], handing on hops[1:]."""
        if not hops:
            return
        first, rest = hops[0], hops[1:]
        failed_at = self._failed_at.get(first.peer_id)
        if failed_at is not None and time.monotonic() - failed_at < DIAL_BACKOFF_S:
            return
        if len(self._tasks) >= MAX_IN_FLIGHT or first.peer_id in self._dialing:
            log.debug("push to %s dropped (%d in flight)", first.peer_id, len(self._tasks))
            return
        payload = {**step, "session_id": first.session_id, "next": [hop.to_wire() for hop in rest]}
        task = asyncio.create_task(self._send(first, payload), name=f"push-{first.peer_id[-8:]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, hop: NextHop, payload: dict[str, Any]) -> None:
        try:
            connection = await self._connection(hop)
            await connection.call("push", payload, timeout=self.timeout_s)
        except SwarmError as error:  # e.g. the next server already has the step from the client, or it is gone
            log.debug("push to %s failed: %s: %s", hop.peer_id, type(error).__name__, error.message)
            dropped = self._connections.get(hop.peer_id)
            if dropped is not None and dropped.is_closed:
                self._connections.pop(hop.peer_id, None)

    async def _connection(self, hop: NextHop) -> RpcConnection:
        """Gives an open stream to `hop`'s server, dialing its announced addresses the first time."""
        connection = self._connections.get(hop.peer_id)
        if connection is not None and not connection.is_closed:
            self._connections.move_to_end(hop.peer_id)
            return connection
        if hop.peer_id in self._dialing:
            raise PeerUnreachable(f"a dial to {hop.peer_id} is in progress; this push is dropped")
        self._dialing.add(hop.peer_id)
        try:
            try:
                addrs = [Multiaddr(addr.split("/p2p/")[0]) for addr in hop.addrs]
                peer = PeerID.from_base58(hop.peer_id)
                await asyncio.wait_for(self.p2p._client.connect(peer, addrs), self.timeout_s)
            except Exception as error:  # a bad address or peer id from the client, or a dead peer
                log.debug("cannot dial %s for a push: %s: %s", hop.peer_id, type(error).__name__, error)
            try:
                connection = await RpcConnection.open(
                    self.p2p, hop.peer_id, timeout=self.timeout_s, max_frame_bytes=self.max_frame_bytes
                )
            except SwarmError:
                self._failed_at[hop.peer_id] = time.monotonic()
                self._failed_at.move_to_end(hop.peer_id)
                while len(self._failed_at) > MAX_FAILED_PEERS:
                    self._failed_at.popitem(last=False)
                raise
        finally:
            self._dialing.discard(hop.peer_id)
        self._failed_at.pop(hop.peer_id, None)
        self._connections[hop.peer_id] = connection
        while len(self._connections) > MAX_PEERS:
            _, evicted = self._connections.popitem(last=False)
            self._close_later(evicted)
        return connection

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
