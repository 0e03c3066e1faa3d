"""A swarm of real OS processes on one machine: a `swarm-dht` bootstrap and `swarm-server`s on 127.0.0.1.

Used by the demo, the integration tests and the benchmarks. Every process is started by `SwarmProcesses`,
whose `close()` always terminates (then kills) all of them, p2pd daemons included (one process group each). A
process group that is killed leaves no socket files behind: what its processes had bound under the temporary
directory (the p2p daemons' and their clients' sockets, multiprocessing's listeners) is removed after the kill.
torch's shared-memory manager runs in a session of its own and removes its directory itself once its clients die
(killed with a network namespace's processes, it cannot: `netem` removes what they had bound, `swarm.temp_files`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from swarm.temp_files import group_socket_files, remove_socket_files

REPO = Path(__file__).resolve().parents[1]  # so `python -m server.cli` resolves without an installed package
START_TIMEOUT_S = 180.0


@dataclass
class Proc:
    """One started OS process and the file its output goes to."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def peer_id(self) -> str:
        for line in self.output().splitlines():
            for word in line.split()[:3] if line.startswith(("ready ", "started ", "orchestrator ready ")) else ():
                if word.startswith("peer_id="):
                    return word.removeprefix("peer_id=")
        raise AssertionError(f"{self.name} has not announced a peer id:\n{self.output()[-3000:]}")


def threads_per_server(servers: int, cores: int | None = None) -> int:
    """Gives the intra-op threads each of `servers` servers on one machine gets, so that together they use its cores
    without oversubscribing them (at least one each)."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, servers))


class SwarmProcesses:
    """Starts and always cleans up the processes of one local swarm; a context manager.

    `torch_threads` > 0 is passed to every server as `--torch-threads` (0: torch's choice, one thread per core in
    each server); see `threads_per_server`.
    """

    def __init__(
        self, workdir: Path, *, announce_period_s: float = 1.0, record_ttl_s: float = 4.0, torch_threads: int = 0
    ) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.announce_period_s, self.record_ttl_s = announce_period_s, record_ttl_s
        self.torch_threads = torch_threads
        self.procs: list[Proc] = []
        self.initial_peers: list[str] = []

    def _spawn(self, name: str, args: list[str], launcher: Sequence[str] = (), *, signed: bool = False) -> Proc:
        """Starts `args` as `name`; `signed` (a DHT node that signs its records): with `--identity`, a fresh key file in
        the workdir, unless `args` names one, so a process killed with SIGKILL leaves no key of its own behind in the
        system's temp dir (`swarm.signing.open_dht` makes one there without an identity, and removes it at exit)."""
        if signed and "--identity" not in args:
            args = [*args, "--identity", str(self.workdir / f"{name}-{len(self.procs)}.identity")]
        log_path = self.workdir / f"{name}.log"
        # Idle OpenMP threads of one process would spin on the cores another process needs to compute.
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), OMP_WAIT_POLICY="PASSIVE")
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                [*launcher, sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                start_new_session=True,
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def _wait_for_line(self, proc: Proc, prefix: str, timeout_s: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in proc.output().splitlines():
                if line.startswith(prefix):
                    return line
            if proc.popen.poll() is not None:
                raise AssertionError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.output()[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"{proc.name} printed no {prefix!r} within {timeout_s} s:\n{proc.output()[-3000:]}")

    def start_dht(self, *, host: str = "127.0.0.1", launcher: Sequence[str] = ()) -> Proc:
        """Starts the bootstrap node and remembers its multiaddrs as the swarm's initial peers.

        `launcher` prefixes the command, e.g. `ip netns exec NS` (netem runs each process in its own namespace,
        listening on that namespace's `host` address)."""
        proc = self._spawn("dht", ["-m", "swarm.dht_cli", "--host", host], launcher, signed=True)
        line = self._wait_for_line(proc, "initial_peers:")
        self.initial_peers = line.split()[1:]
        return proc

    def start_server(self, model: str | Path, blocks: str | None, *extra: str, name: str | None = None,
                     wait: bool = True, host: str = "127.0.0.1", launcher: Sequence[str] = ()) -> Proc:
        """Starts a swarm-server for `blocks` of `model` (None: the blocks its orchestrator assigns, or that it
        chooses); with `wait`, returns once it is serving, or, when it follows an orchestrator, once it started.
        One client here plays many users (tests, benchmarks), so servers take no per-client quota unless `extra`
        sets one (`--client-max-sessions`, `--client-kv-share`)."""
        block_args = ["--blocks", blocks] if blocks else []
        args = ["-m", "server.launch", "--model", str(model), *block_args, "--host", host,
                "--initial-peers", *self.initial_peers, "--announce-period", str(self.announce_period_s),
                "--record-ttl", str(self.record_ttl_s), "--client-max-sessions", "0", "--client-kv-share", "1",
                *extra]
        if self.torch_threads > 0 and "--torch-threads" not in extra:
            args += ["--torch-threads", str(self.torch_threads)]
        label = blocks.replace(":", "-") if blocks else "auto"
        proc = self._spawn(name or f"server-{label}-{len(self.procs)}", args, launcher, signed=True)
        if wait and blocks is None and "--orchestrator" in extra:
            self.wait_started(proc)
        elif wait:
            self.wait_ready(proc)
        return proc

    def start_orchestrator(self, model: str | Path, *extra: str, name: str | None = None, host: str = "127.0.0.1",
                           launcher: Sequence[str] = ()) -> Proc:
        """Starts a swarm-orchestrator for `model`; returns once it serves."""
        args = ["-m", "orchestrator.service.cli", "--model", str(model), "--host", host,
                "--initial-peers", *self.initial_peers, "--announce-period", str(self.announce_period_s),
                "--record-ttl", str(self.record_ttl_s), *extra]
        proc = self._spawn(name or f"orchestrator-{len(self.procs)}", args, launcher, signed=True)
        self._wait_for_line(proc, "orchestrator ready peer_id=")
        return proc

    def start_api(self, model: str | Path, *extra: str, name: str | None = None) -> tuple[Proc, str]:
        """Starts a swarm-api for `model` on a free loopback port; gives it and its base URL once it listens."""
        args = ["-m", "api.cli", "--model", str(model), "--initial-peers", *self.initial_peers, "--host", "127.0.0.1",
                "--port", "0", *extra]
        proc = self._spawn(name or f"api-{len(self.procs)}", args)
        return proc, self._wait_for_line(proc, "ready http://").split()[1]

    def wait_ready(self, proc: Proc) -> None:
        self._wait_for_line(proc, "ready peer_id=")

    def wait_started(self, proc: Proc) -> None:
        """Waits until the server `proc` started: a follower of an orchestrator serves only once it assigns blocks."""
        self._wait_for_line(proc, "started peer_id=")

    def run_in_background(self, args: list[str], name: str | None = None) -> Proc:
        """Starts a Python process with `args` (e.g. a client script); `close()` stops it like the others."""
        return self._spawn(name or f"run-{len(self.procs)}", args)

    def wait_for_line(self, proc: Proc, prefix: str, timeout_s: float = START_TIMEOUT_S) -> str:
        """Gives the first line of `proc`'s output that starts with `prefix`, waiting for it."""
        return self._wait_for_line(proc, prefix, timeout_s)

    def run_to_exit(self, args: list[str], timeout_s: float = 120.0) -> tuple[int, str]:
        """Runs a command to completion; gives its exit code and output."""
        proc = self._spawn(f"run-{len(self.procs)}", args)
        proc.popen.wait(timeout=timeout_s)
        return proc.popen.returncode, proc.output()

    def kill(self, proc: Proc, signum: int = signal.SIGKILL, bound: Sequence[Path] = ()) -> None:
        """Sends `signum` to the process group of `proc` (p2pd daemons included); after SIGKILL, removes the socket
        files its processes had bound (and `bound`, read before an earlier signal), which they can no longer remove
        themselves."""
        sockets = [*bound, *group_socket_files(proc.popen.pid)] if signum == signal.SIGKILL else []
        try:
            os.killpg(proc.popen.pid, signum)
        except ProcessLookupError:
            pass  # the group is gone already: what `bound` holds is left behind all the same
        remove_socket_files(sockets)  # killed, its processes bind nothing again

    def close(self) -> None:
        """Stops every process: servers first, then the bootstrap, each with SIGTERM to its own process (a clean
        drain), then SIGKILL to whatever is left of its group (p2pd daemons included)."""
        servers = [proc for proc in self.procs if proc.name != "dht"]
        bootstraps = [proc for proc in self.procs if proc.name == "dht"]
        for group in (servers, bootstraps):
            # read before the SIGTERM: a process that it ends at once (no handler) can no longer be read after
            bound = {proc.popen.pid: group_socket_files(proc.popen.pid) for proc in group}
            for proc in group:
                if proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            for proc in group:
                try:
                    proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                self.kill(proc, signal.SIGKILL, bound[proc.popen.pid])
                proc.popen.wait(timeout=10)

    def __enter__(self) -> SwarmProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
