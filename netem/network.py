"""One emulated wide-area network: the run's namespaces and links, a delay backend, and processes inside hosts.

    with EmulatedNetwork(topology) as network:          # wires, picks tc or the fabric, starts it
        server = network.spawn("h1", ["python", "-m", "http.server", "--bind", network.address("h1")])
        ...                                             # anything in "h0" now sees h1 at the topology's RTT
    # every process, namespace and link of the run is gone here, also after an exception or SIGTERM

Teardown is certain three ways: the context manager (and `close()`), SIGTERM/SIGHUP handlers that unwind it
(SIGINT already does), and `down(run_id)` (`swarm-netem down RUN`) for whatever a killed owner left behind: it
finds a run by its namespace prefix, stops every process living in those namespaces and deletes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from netem import netns
from netem.backends import DelayBackend, backend_by_name, choose_backend
from netem.layout import Layout, wire
from netem.processes import HostProcess, namespace_command
from netem.topology import Topology

STATE_ROOT = Path(os.environ.get("CHAINSWARM_NETEM_STATE", "/run/chainswarm-netem"))
UNWIND_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def raise_exit(signum: int, _frame: FrameType | None) -> None:
    """Signal handler that unwinds the stack (so `finally` and `with` clean up) as a SystemExit(128 + signum)."""
    raise SystemExit(128 + signum)


def state_dir(run_id: str) -> Path:
    return STATE_ROOT / netns.check_run_id(run_id)


def down(run_id: str) -> list[str]:
    """Gives the namespaces removed after stopping every process of run `run_id` and deleting its state."""
    layout_dir = state_dir(run_id)
    removed = netns.remove_run(run_id)
    shutil.rmtree(layout_dir, ignore_errors=True)
    return removed


class EmulatedNetwork:
    """The namespaces, links, delay backend and processes of one run; a context manager that always cleans up."""

    def __init__(
        self, topology: Topology, *, run_id: str | None = None, backend: str = "auto", realtime: bool = True
    ) -> None:
        self.topology = topology
        self.run_id = netns.check_run_id(run_id or netns.new_run_id())
        self.layout = Layout(self.run_id, topology.hosts, state_dir(self.run_id))
        self.requested_backend = backend
        self.realtime = realtime
        self.backend: DelayBackend | None = None
        self.processes: list[HostProcess] = []
        self._previous_handlers: dict[int, Any] = {}
        self._closed = False

    # lifecycle

    def start(self) -> EmulatedNetwork:
        """Wires the run and starts its delay backend; on any failure removes what was made and re-raises."""
        if netns.list_namespaces(netns.run_prefix(self.run_id)):
            raise RuntimeError(f"run {self.run_id} already exists; pick another id or `swarm-netem down` it")
        try:
            self.layout.state_dir.mkdir(parents=True, exist_ok=True)
            self._write_state("starting")
            wire(self.layout)
            self.backend = choose_backend(self.requested_backend, self.layout, realtime=self.realtime)
            self.backend.start(self.topology)
            self._write_state("up")
        except BaseException:
            self.close()
            raise
        return self

    def _write_state(self, status: str) -> None:
        (self.layout.state_dir / "topology.json").write_text(self.topology.to_json())
        state = {
            "run_id": self.run_id, "status": status, "hosts": list(self.topology.hosts),
            "addresses": dict(zip(self.topology.hosts, self.layout.addresses, strict=True)),
            "backend": self.backend.name if self.backend else None, "owner_pid": os.getpid(), "created": time.time(),
        }
        (self.layout.state_dir / "run.json").write_text(json.dumps(state, indent=1))

    @classmethod
    def attach(cls, run_id: str) -> EmulatedNetwork:
        """Gives a handle on a run started elsewhere (e.g. by `swarm-netem up`); closing it takes the run down."""
        directory = state_dir(run_id)
        try:
            state = json.loads((directory / "run.json").read_text())
            topology = Topology.from_json((directory / "topology.json").read_text())
        except FileNotFoundError:
            raise RuntimeError(f"no run {run_id} here (see `swarm-netem list`)") from None
        if state.get("status") != "up" or not netns.list_namespaces(netns.run_prefix(run_id)):
            raise RuntimeError(f"run {run_id} is not up (status {state.get('status')}); `swarm-netem down {run_id}`")
        network = cls(topology, run_id=run_id)
        network.backend = backend_by_name(state["backend"], network.layout)
        return network

    def close(self) -> None:
        """Stops this run's processes and backend, then removes its namespaces, links and state (idempotent)."""
        if self._closed:
            return
        self._closed = True
        in_main = threading.current_thread() is threading.main_thread()
        # A second SIGTERM/SIGINT must not cut the cleanup short: hold them until it is done.
        blocked = {signal.SIGINT, *UNWIND_SIGNALS}
        if in_main:
            signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            for process in reversed(self.processes):
                process.stop()
            if self.backend is not None:
                with contextlib.suppress(Exception):  # down() below stops it regardless
                    self.backend.stop()
            down(self.run_id)
        finally:
            if in_main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)

    def __enter__(self) -> EmulatedNetwork:
        if threading.current_thread() is threading.main_thread():
            for signum in UNWIND_SIGNALS:
                self._previous_handlers[signum] = signal.signal(signum, raise_exit)
        try:
            return self.start()
        except BaseException:
            self._restore_handlers()
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.close()
        finally:
            self._restore_handlers()

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    # hosts

    @property
    def hosts(self) -> tuple[str, ...]:
        return self.topology.hosts

    def namespace(self, host: str) -> str:
        return self.layout.namespace(host)

    def address(self, host: str) -> str:
        """Gives the private address `host` is reached at from the other hosts."""
        return self.layout.address(host)

    def host_env(self, host: str) -> dict[str, str]:
        """Gives the environment variables that tell a process inside `host` where it runs."""
        return {"NETEM_RUN": self.run_id, "NETEM_HOST": host, "NETEM_ADDRESS": self.address(host)}

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """Gives the argv that runs `argv` inside `host`'s namespace."""
        return namespace_command(self.namespace(host), argv)

    def spawn(
        self, host: str, argv: Sequence[str], *, name: str | None = None, log_dir: Path | None = None,
        env: Mapping[str, str] | None = None, interactive: bool = False,
    ) -> HostProcess:
        """Gives a process running `argv` inside `host`, stopped by `close()` at the latest."""
        name = name or f"{host}-{len(self.processes)}"
        log_path = (log_dir or self.layout.state_dir) / f"{name}.log"
        process = HostProcess.start(name, host, self.namespace(host), argv, log_path,
                                    env={**self.host_env(host), **(env or {})}, interactive=interactive)
        self.processes.append(process)
        return process

    # the network

    def set_topology(self, topology: Topology) -> None:
        """Changes RTTs, bandwidths and loss of the running network (same hosts, same order)."""
        if topology.hosts != self.topology.hosts:
            raise ValueError("a running network keeps its hosts; start a new run for other hosts")
        assert self.backend is not None, "not started"
        self.backend.update(topology)
        self.topology = topology
        (self.layout.state_dir / "topology.json").write_text(topology.to_json())

    def backend_stats(self) -> dict[str, Any]:
        assert self.backend is not None, "not started"
        return self.backend.stats()

    def reset_backend_stats(self) -> None:
        assert self.backend is not None, "not started"
        self.backend.reset_stats()
