"""A server's batches, one JSON line each, for comparing a live run with the simulator batch by batch.

`swarm-server --batch-trace PATH` appends a line per batch its scheduler computed: when it started and ended on the
compute thread and when the event loop settled it (wall-clock seconds, `time.time()`, so that the lines of servers
on one machine line up with each other and with their clients'), its compute and CPU time, and each step in it: its
session, the tokens it computed, whether it is a decode step, and when it was admitted. The simulator's members'
batches (`orchestrator.sim.kunserve_sim`) are the same records; where the live ones spend more than their compute
(waiting for a batch, the hand-over from the compute thread to the event loop) shows here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from server.sessions import Step

log = logging.getLogger(__name__)

FLUSH_LINES = 64  # lines buffered before they are written out (a batch's line is about 200 bytes)
FLUSH_S = 1.0  # or at the first line this long after the last write-out


class BatchTrace:
    """Appends batch records to a JSON-lines file; usable from any thread."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] | None = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._pending = 0
        self._flushed_s = time.monotonic()
        self.written = 0  # records so far

    def note(self, record: dict[str, object]) -> None:
        """Appends `record` (JSON-serialisable); nothing once closed. A write that fails (a full disk) ends the trace
        with a warning: the batches go on, untraced."""
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line)
                self.written += 1
                self._pending += 1
                now = time.monotonic()
                if self._pending >= FLUSH_LINES or now - self._flushed_s >= FLUSH_S:
                    self._file.flush()
                    self._pending, self._flushed_s = 0, now
            except OSError as error:
                log.warning("batch trace %s stopped after %d lines: %s", self.path, self.written, error)
                file, self._file = self._file, None
                with contextlib.suppress(OSError):
                    file.close()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def batch_record(batch: Sequence[tuple[Step, int]], span: tuple[float, float], compute_ms: float, cpu_ms: float, *,
                 joined: int, place: str, passed: bool) -> dict[str, object]:
    """Gives the trace's record of a batch of (step, tokens it computed of it) that the computing thread ran over
    `span` (`time.perf_counter()` stamps), settled now: each step as [session id, tokens computed (rows x tokens),
    whether it is a decode step, when it was admitted (wall s)]."""
    now_wall = time.time()
    offset = now_wall - time.perf_counter()  # a perf_counter() stamp of this process plus this is its wall time

    def wall(perf_s: float) -> float:
        return round(perf_s + offset, 4)

    return {
        "start": wall(span[0]), "end": wall(span[1]), "settled": round(now_wall, 4),
        "compute_ms": round(compute_ms, 2), "cpu_ms": round(cpu_ms, 2), "place": place, "passed": passed,
        "joined": joined,
        "steps": [[step.session.session_id, take * step.rows, step.tokens == 1, wall(step.admitted_s)]
                  for step, take in batch],
    }
