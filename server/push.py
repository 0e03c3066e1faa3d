"""Server-to-server push: a step's output goes straight to the next server of the chain, as in Petals.

The client still sends every server its step (and keeps every input for replay), so a push is only a head
start: the next server begins computing one network leg earlier, and the client's own copy of the step finds
the work running or done (same step id). A failed push costs nothing but that head start, so failures are
logged, never raised.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm.errors import SwarmError
from swarm.records import NextHop
from swarm.rpc import RpcConnection

log = logging.getLogger(__name__)


class Pusher:
    """Owns this server's streams to next servers (one per peer) and the tasks that push on them."""

    def __init__(self, p2p: P2P, *, timeout_s: float, max_frame_bytes: int) -> None:
        self.p2p = p2p
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._connections: dict[str, RpcConnection] = {}
        self._dialing: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def push(self, hops: list[NextHop], step: dict[str, Any]) -> None:
        """Starts sending `step` (a `push` payload without session and route) to hops[0], handing on hops[1:]."""
        if not hops:
            return
        first, rest = hops[0], hops[1:]
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
        lock = self._dialing.setdefault(hop.peer_id, asyncio.Lock())
        async with lock:
            connection = self._connections.get(hop.peer_id)
            if connection is not None and not connection.is_closed:
                return connection
            try:
                addrs = [Multiaddr(addr.split("/p2p/")[0]) for addr in hop.addrs]
                peer = PeerID.from_base58(hop.peer_id)
                await asyncio.wait_for(self.p2p._client.connect(peer, addrs), self.timeout_s)
            except Exception as error:  # a bad address or peer id from the client, or a dead peer
                log.debug("cannot dial %s for a push: %s: %s", hop.peer_id, type(error).__name__, error)
            connection = await RpcConnection.open(
                self.p2p, hop.peer_id, timeout=self.timeout_s, max_frame_bytes=self.max_frame_bytes
            )
            self._connections[hop.peer_id] = connection
            return connection

    async def close(self) -> None:
        """Cancels pending pushes and closes every stream."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for connection in self._connections.values():
            await connection.close()
        self._connections.clear()
