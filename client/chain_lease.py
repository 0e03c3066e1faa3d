"""A chain leased from the model's orchestrator (JFFC): acquired before a session opens, renewed while it runs,
released when it closes. A client that cannot reach an orchestrator within `orchestrator_timeout_s` routes by
itself over the DHT records, as it does in a swarm without one."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from swarm.records import ServerRecord
from swarm.rpc import RpcConnection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeasedSpan:
    """Blocks [start, end) of a leased chain, on one server."""

    peer_id: str
    start: int
    end: int
    record: ServerRecord | None = None  # the server's record as the orchestrator last read it (saves a DHT lookup)


class ChainLease:
    """One session's slot on a chain; renews itself on the client's loop until released."""

    def __init__(
        self, connection: RpcConnection, lease_id: str, spans: list[LeasedSpan], *, ttl_s: float, timeout_s: float
    ) -> None:
        self.connection, self.lease_id, self.spans = connection, lease_id, spans
        self.ttl_s, self.timeout_s = ttl_s, timeout_s
        self._renewer = asyncio.create_task(self._renew_forever(), name="renew-lease")

    @staticmethod
    def spans_from_wire(obj: object) -> list[LeasedSpan]:
        """Gives the spans of an `acquire` reply; raises ValueError unless they cover blocks from 0 in order."""
        if not isinstance(obj, list) or not obj:
            raise ValueError(f"a lease's spans must be a non-empty list, got {obj!r:.100}")
        spans, expected_start = [], 0
        for item in obj:
            if not isinstance(item, dict):
                raise ValueError(f"a lease span must be a map, got {item!r:.100}")
            peer_id, start, end = item.get("peer_id"), item.get("start"), item.get("end")
            if not (isinstance(peer_id, str) and isinstance(start, int) and isinstance(end, int)):
                raise ValueError(f"a lease span needs peer_id, start and end, got {item!r:.100}")
            if start != expected_start or end <= start:
                raise ValueError(f"lease spans must follow each other from block 0, got {obj!r:.200}")
            record = ServerRecord.from_wire(item["record"]) if "record" in item else None
            if record is not None and record.peer_id != peer_id:
                raise ValueError(f"a lease span's record is of {record.peer_id}, not {peer_id}")
            spans.append(LeasedSpan(peer_id, start, end, record))
            expected_start = end
        return spans

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(max(0.1, self.ttl_s / 3))
            try:
                await self.connection.call("renew", {"lease_id": self.lease_id}, timeout=self.timeout_s)
            except Exception as error:  # the orchestrator went away: the session goes on, the lease expires there
                log.info("could not renew lease %s: %s", self.lease_id, error)
                return

    async def release(self, tokens: int) -> None:
        """Gives the slot back (the session reached `tokens` tokens); the orchestrator may be gone already."""
        self._renewer.cancel()
        await asyncio.gather(self._renewer, return_exceptions=True)
        try:
            await self.connection.call("release", {"lease_id": self.lease_id, "tokens": tokens},
                                       timeout=self.timeout_s)
        except Exception as error:
            log.info("could not release lease %s: %s", self.lease_id, error)
        finally:
            await self.connection.close()
