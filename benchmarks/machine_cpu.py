"""What a live run's processes cost the machine's cores, by role: a sampler, and the costs fitted from its samples.

`kunserve_burst.py`'s simulator shares the cores among what it models: the members' batches and the client's head
passes (`KunServeSimConfig.cores`). The machine runs more: the p2pd daemons on both sides of every RPC, the delay
fabric that forwards every packet at SCHED_FIFO, the DHT nodes, the client's own DHT process that a waiting client's
lookups run in. The sampler reads every process the benchmark started (its process tree) once a second; the fit
splits the CPU of all but the servers and the client's main process (the untracked) into a part per token the
swarm generated and a part per refused round (a waiting client's round that ended in a back-off), by least squares
over the sampler's intervals with a constant for what runs anyway. The client's main process adds its own part of a
refused round; its part per token is the client's work, which the simulator counts already.

On this VM (r27-r28, the no-drop arm, a scratch sampler of the same processes): 4.1-4.8 ms of untracked CPU a token
and 62-83 ms a refused round, plus 8 ms of the client's main process a round; r29, this sampler: 4.1 ms a token, 63
ms and 4.5 ms a round. `benchmarks/refused_tries.py`, on loopback without the fabric, reads 43-44 ms a round for all
processes together.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

SAMPLE_S = 1.0  # between two samples
ROLES = (  # a process's role, by what its command line holds (the first that matches)
    ("netem.fabric", "fabric"),
    ("p2pd", "p2pd"),
    ("table1_client", "client"),
    ("server.launch", "server"),
    ("swarm-server", "server"),
    ("dht_cli", "dht"),
    ("mell_live_monitor", "monitor"),
)
TRACKED = ("server", "client")  # the simulator's own processes: their main ones, not their forked children (DHT nodes)


@dataclass(frozen=True)
class UntrackedCpu:
    """The fit: CPU outside the simulator's processes per generated token (ms) that crossed one whole server
    (`token_ms`) and that crossed a group's members (`piped_token_ms`, None where none did), per refused round (ms,
    None where no round was refused), and the client main process's own part of a refused round (ms); from
    `intervals` sampler intervals."""

    token_ms: float
    round_ms: float | None
    client_round_ms: float
    intervals: int
    piped_token_ms: float | None = None

    @property
    def refused_round_ms(self) -> float | None:
        """Gives all the CPU a refused round costs the machine, None where no round was refused."""
        return None if self.round_ms is None else self.round_ms + self.client_round_ms


def role_of(command: str) -> str:
    return next((role for key, role in ROLES if key in command), "other")


class CpuSampler:
    """Appends, every `SAMPLE_S`, one JSON line to `path`: the wall time and, for every process in this process's
    tree, `[pid, parent pid, role, CPU seconds so far]`. A context manager: sampling runs in a thread between enter
    and exit."""

    def __init__(self, path: Path, period_s: float = SAMPLE_S) -> None:
        self.path, self.period_s = path, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        root = psutil.Process()
        with self.path.open("a") as out:
            while not self._stop.is_set():
                rows = []
                for process in root.children(recursive=True):
                    try:
                        with process.oneshot():
                            times = process.cpu_times()
                            rows.append([process.pid, process.ppid(), role_of(" ".join(process.cmdline())),
                                         times.user + times.system])
                    except psutil.Error:  # exited between listing and reading
                        continue
                out.write(json.dumps({"t": time.time(), "procs": rows}) + "\n")
                out.flush()
                self._stop.wait(self.period_s)


def read_samples(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fit_untracked(samples: list[dict], token_times_wall: Sequence[float], round_ends_wall: Sequence[float],
                  piped_times_wall: Sequence[float] = ()) -> UntrackedCpu | None:
    """Fits `UntrackedCpu` on the sampler's `samples` and the wall times at which the swarm's tokens came out (those
    through one whole server, `token_times_wall`, and those through a group's members, `piped_times_wall`) and
    refused rounds ended (a back-off began); None with fewer than 10 intervals. A kind of event that never happened
    gets no column in the fit (its figure None)."""
    if len(samples) < 11:
        return None
    events = [np.sort(np.asarray(times, dtype=float))
              for times in (token_times_wall, piped_times_wall, round_ends_wall)]
    rows, untracked, client = [], [], []
    for before, after in itertools.pairwise(samples):
        seconds = after["t"] - before["t"]
        if seconds <= 0:
            continue
        earlier = {pid: cpu for pid, _parent, _role, cpu in before["procs"]}
        mains = _main_processes(after["procs"])
        spent = {"untracked": 0.0, "client": 0.0}
        for pid, _parent, _role, cpu in after["procs"]:
            if pid not in earlier:
                continue
            used = cpu - earlier[pid]
            if mains.get(pid) == "client":
                spent["client"] += used
            elif pid not in mains:  # the servers' and the client's DHT nodes (forked) too
                spent["untracked"] += used
        rows.append([1.0] + [_within(times, before["t"], after["t"]) / seconds for times in events])
        untracked.append(spent["untracked"] / seconds * 1000)
        client.append(spent["client"] / seconds * 1000)
    if len(rows) < 10:
        return None
    seen = [0] + [column + 1 for column, times in enumerate(events) if times.size]
    design = np.asarray(rows)[:, seen]
    per_event = dict(zip(seen, np.linalg.lstsq(design, np.asarray(untracked), rcond=None)[0], strict=True))
    client_per_event = dict(zip(seen, np.linalg.lstsq(design, np.asarray(client), rcond=None)[0], strict=True))
    fitted = {column: max(0.0, float(value)) for column, value in per_event.items()}
    return UntrackedCpu(fitted.get(1, 0.0), fitted.get(3), max(0.0, float(client_per_event.get(3, 0.0))), len(rows),
                        piped_token_ms=fitted.get(2))


def _within(times: np.ndarray, start: float, end: float) -> int:
    """Gives how many of the sorted `times` fall in [start, end)."""
    return int(np.searchsorted(times, end) - np.searchsorted(times, start))


def _main_processes(procs: list[list]) -> dict[int, str]:
    """Gives the main processes of the `TRACKED` roles, by pid: those whose parent has another role (their DHT
    nodes are forked from them, with the same command line)."""
    roles = {pid: role for pid, _parent, role, _cpu in procs}
    return {pid: role for pid, parent, role, _cpu in procs if role in TRACKED and roles.get(parent) != role}
