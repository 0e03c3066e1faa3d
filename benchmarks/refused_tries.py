"""What a waiting client's refused round costs the machine it shares with the swarm, in CPU milliseconds.

    python benchmarks/refused_tries.py [--waiters 24] [--window 20]

A round is what a client does before it backs off while every server is full: a DHT lookup, RTT probes, and an
`open` call that each server refuses (`client.inference`). On one machine the client, the DHT and the servers that
answer share its cores, so a crowd of waiting clients slows the sessions that run. `kunserve_burst.py`'s simulator
counts each refused round against the cores with this cost (`KunServeSimConfig.refused_try_cpu_ms`).

The rig, on loopback: the DHT and two servers of every block, with the flags the caller gives (kunserve_burst: its
no-drop arm's); this process opens sessions until both servers refuse one, lets `--waiters` threads wait for a
session each (backing off, as the benchmark's clients), and reads the CPU time of every process (the servers', the
DHT's, this one's, and their p2pd daemons) over `--window` seconds, three times. The cost is that CPU, less the same
swarm's while no one waits, over the rounds that ended in a back-off meanwhile (the waiters' `open_attempts`): the
median of the three windows.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from client.inference import InferenceSession
from client.model import DistributedModelForCausalLM
from client.swarm_client import ClientConfig
from swarm.errors import ServerBusy
from swarm.local_swarm import SwarmProcesses
from swarm.model import DEFAULT_MODEL

SETTLE_S = 8.0  # the waiters' back-offs reach their longest (0.5 s doubling to 4 s) before the windows open
WINDOWS = 3  # windows of `window_s` read one after the other; the median's reading is kept
MAX_HELD = 64  # sessions the rig opens at most while filling the servers


@dataclass(frozen=True)
class RefusedTries:
    """The rig's reading: the CPU cost of one refused round (ms), and what it was taken from."""

    cpu_ms: float
    rounds: int  # rounds that ended in a back-off within its window
    waiting_cores: float  # the swarm's CPU (cores) while the waiters waited, in that window
    idle_cores: float  # and while no one waited
    window_s: float


def _cpu_s() -> float:
    """Gives the CPU seconds this process and its descendants (the swarm it started, their p2pd daemons) have used
    so far."""
    total = 0.0
    root = psutil.Process()
    for each in (root, *root.children(recursive=True)):
        try:
            times = each.cpu_times()
        except psutil.Error:  # exited between listing and reading
            continue
        total += times.user + times.system
    return total


def _cores(seconds: float) -> float:
    started_cpu, started = _cpu_s(), time.perf_counter()
    time.sleep(seconds)
    return (_cpu_s() - started_cpu) / (time.perf_counter() - started)


def measure(server_flags: Sequence[str], *, max_length: int, waiters: int = 24, window_s: float = 20.0
            ) -> RefusedTries:
    """Runs the rig (module docstring) with servers started with `server_flags` and sessions of `max_length`."""
    client_log = logging.getLogger("client.inference")
    level = client_log.level
    client_log.setLevel(logging.ERROR)  # the waiters' refusals (a warning each) are what the rig makes, not news
    try:
        return _measure(server_flags, max_length=max_length, waiters=waiters, window_s=window_s)
    finally:
        client_log.setLevel(level)


def _measure(server_flags: Sequence[str], *, max_length: int, waiters: int, window_s: float) -> RefusedTries:
    with tempfile.TemporaryDirectory(prefix="refused-tries-") as scratch, \
            SwarmProcesses(Path(scratch), announce_period_s=5.0, record_ttl_s=30.0,
                           torch_threads=1) as swarm:
        swarm.start_dht()
        servers = [swarm.start_server(DEFAULT_MODEL, "0:30", *server_flags, wait=False, name=name)
                   for name in ("a", "b")]
        for server in servers:
            swarm.wait_ready(server)
        config = ClientConfig(orchestrator=None, busy_wait_s=0.0)
        model = DistributedModelForCausalLM.from_pretrained(DEFAULT_MODEL, initial_peers=swarm.initial_peers,
                                                            client_config=config)
        held: list[InferenceSession] = []
        opened: list[InferenceSession] = []
        threads: list[threading.Thread] = []
        try:
            while len(held) < MAX_HELD:
                try:
                    held.append(model.inference_session(max_length=max_length))
                except ServerBusy:
                    break
            else:
                raise RuntimeError(f"the servers took {MAX_HELD} sessions and refused none")
            idle = _cores(window_s)
            config.busy_wait_s = 600.0

            def wait() -> None:
                session = model.inference_session(max_length=max_length)
                opened.append(session)
                session.close()

            threads = [threading.Thread(target=wait, daemon=True) for _ in range(waiters)]
            for thread in threads:
                thread.start()
            time.sleep(SETTLE_S)
            windows = []
            for _ in range(WINDOWS):
                started = time.perf_counter()
                windows.append((started, _cores(window_s), time.perf_counter()))
        finally:
            for session in held:
                session.close()
            for thread in threads:
                thread.join(60)
            model.shutdown()
    if len(opened) < waiters:
        raise RuntimeError(f"{len(opened)} of {waiters} waiters opened")
    readings = []
    for started, waiting, ended in windows:
        rounds = sum(1 for session in opened for attempt in session.open_attempts
                     if attempt.kind == "backoff" and started <= attempt.ended_s <= ended)
        if rounds == 0:
            raise RuntimeError(f"no round backed off in a window of {ended - started:.1f} s")
        cpu_ms = max(0.0, waiting - idle) * (ended - started) / rounds * 1000
        readings.append(RefusedTries(cpu_ms, rounds, waiting, idle, ended - started))
    return sorted(readings, key=lambda reading: reading.cpu_ms)[len(readings) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waiters", type=int, default=24)
    parser.add_argument("--window", type=float, default=20.0)
    args = parser.parse_args(argv)
    from benchmarks.kunserve_burst import MAX_OUTPUT, MAX_PROMPT, server_flags

    reading = measure(server_flags("no drop", "a", 3)[1], max_length=MAX_PROMPT + MAX_OUTPUT, waiters=args.waiters,
                      window_s=args.window)
    print(f"a refused round: {reading.cpu_ms:.1f} ms of CPU ({reading.rounds} rounds in {reading.window_s:.1f} s; "
          f"the swarm used {reading.waiting_cores:.3f} cores with {args.waiters} waiting, {reading.idle_cores:.3f} "
          f"without)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
