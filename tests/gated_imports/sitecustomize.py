"""Holds the KV that migrations bring into the server process it is loaded into: past the first `import_kv` frame of
each import, frames wait while the file named by `CHAINSWARM_TEST_IMPORT_GATE` exists.

A migration test puts this folder first on a server's PYTHONPATH (Python imports `sitecustomize` at start) to stop
a move in its middle for as long as the test needs. A signal sent once the first chunk arrived could come after the
move had ended; the product has no such switch."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from server.server import SwarmServer

GATE = Path(os.environ["CHAINSWARM_TEST_IMPORT_GATE"])
_import_kv = SwarmServer._import_kv
_frames_seen: dict[str, int] = {}


async def _gated_import_kv(self: SwarmServer, payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
    session_id = str(payload.get("session_id"))
    _frames_seen[session_id] = _frames_seen.get(session_id, 0) + 1
    while _frames_seen[session_id] > 1 and GATE.exists():
        await asyncio.sleep(0.02)
    return await _import_kv(self, payload, ctx)


SwarmServer._import_kv = _gated_import_kv  # type: ignore[method-assign]
