"""Delay backends behind one interface: `tc` (kernel netem) where the kernel has it, else the user-space fabric.

A backend gets a wired `Layout` and makes packets between its hosts take the topology's RTTs: `start(topology)`,
`update(topology)` (new delays at run time), `stats()`, `reset_stats()`, `stop()`. `choose_backend` picks one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from netem import netns
from netem.fabric import FabricConfig
from netem.layout import Layout, ip_batch
from netem.tc import TcBackend, netem_available
from netem.topology import Topology

REPO = Path(__file__).resolve().parents[1]
FABRIC_TUN = "fab0"
FABRIC_TABLE = "100"
FABRIC_READY_TIMEOUT_S = 20.0
FABRIC_TXQUEUE = "10000"  # packets the kernel may queue for the fabric before it reads them
BACKENDS = ("auto", "tc", "fabric")


class DelayBackend(Protocol):
    name: str

    def start(self, topology: Topology) -> None: ...

    def update(self, topology: Topology) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def reset_stats(self) -> None: ...

    def stop(self) -> None: ...


def control_request(path: Path, request: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
    """Gives the fabric's JSON answer to one request on its control socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(str(path))
        conn.sendall(json.dumps(request).encode() + b"\n")
        reply = bytearray()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in reply and time.monotonic() < deadline:
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            reply += chunk
    answer = json.loads(reply.split(b"\n", 1)[0] or b"{}")
    if "error" in answer:
        raise RuntimeError(f"fabric refused {request.get('op')!r}: {answer['error']}")
    return answer


def _bandwidths(topology: Topology) -> list[float | None]:
    return [topology.bandwidth_mbit.get(host) for host in topology.hosts]


class FabricBackend:
    """Delays in the user-space fabric (`netem.fabric`), one process inside the router namespace.

    The router sends every packet arriving from a host's veth into the TUN device (policy rule `iif v<i>` ->
    table 100 -> `fab0`); what the fabric writes back is routed normally, to the destination's veth. If the fabric
    dies, table 100 keeps an `unreachable` route, so traffic stops instead of flowing undelayed.
    """

    name = "fabric"

    def __init__(self, layout: Layout, *, realtime: bool = True) -> None:
        self.layout = layout
        self.realtime = realtime
        self.config_path = layout.state_dir / "fabric.json"
        self.control_path = layout.state_dir / "fabric.sock"
        self.log_path = layout.state_dir / "fabric.log"
        self.pid_path = layout.state_dir / "fabric.pid"
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self, topology: Topology) -> None:
        config = FabricConfig(
            tun=FABRIC_TUN, addresses=self.layout.addresses, rtt_ms=[list(row) for row in topology.rtt_ms],
            bandwidth_mbit=_bandwidths(topology), control=str(self.control_path),
            loss_pct=[list(row) for row in topology.loss_pct] if topology.loss_pct else None, realtime=self.realtime,
        )
        self.config_path.write_text(json.dumps(dataclasses.asdict(config)))
        hub = self.layout.hub
        # The safety route first: from now on, traffic from hosts goes to the fabric or nowhere.
        ip_batch(hub, [f"route add unreachable default metric 4000000000 table {FABRIC_TABLE}"] + [
            f"rule add iif {self.layout.hub_device(i)} lookup {FABRIC_TABLE} pref 100"
            for i in range(len(self.layout.hosts))
        ])
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                ["ip", "netns", "exec", hub, sys.executable, "-m", "netem.fabric", "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                start_new_session=True,  # outlives `swarm-netem up`; stopped by `down`
            )
        self.pid_path.write_text(str(self.popen.pid))
        self._wait_ready()
        ip_batch(hub, [
            f"link set {FABRIC_TUN} up txqueuelen {FABRIC_TXQUEUE}",
            f"route add default dev {FABRIC_TUN} table {FABRIC_TABLE}",
        ])

    def _wait_ready(self) -> None:
        assert self.popen is not None
        deadline = time.monotonic() + FABRIC_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if "fabric ready" in self.log_path.read_text(errors="replace"):
                return
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"the fabric did not start:\n{self.log_path.read_text(errors='replace')[-2000:]}")

    def update(self, topology: Topology) -> None:
        control_request(self.control_path, {
            "op": "update", "rtt_ms": [list(row) for row in topology.rtt_ms], "bandwidth_mbit": _bandwidths(topology),
            "loss_pct": [list(row) for row in topology.loss_pct] if topology.loss_pct else None,
        })

    def stats(self) -> dict[str, Any]:
        return control_request(self.control_path, {"op": "stats"})

    def reset_stats(self) -> None:
        control_request(self.control_path, {"op": "reset"})

    def stop(self) -> None:
        pid = self.popen.pid if self.popen is not None else _read_pid(self.pid_path)
        # A pid from the state file is only ours while it lives in the router namespace (pids get reused).
        if pid is None or (self.popen is None and pid not in netns.namespace_pids(self.layout.hub)):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        elif netns.wait_gone([pid], 5.0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def choose_backend(requested: str, layout: Layout, *, realtime: bool = True) -> DelayBackend:
    """Gives the backend to use: `tc` if asked for or if `auto` and the kernel has netem, else the fabric."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested in ("auto", "tc"):
        if netem_available(layout.hub):
            return TcBackend(layout)
        if requested == "tc":
            raise RuntimeError("the tc backend needs the kernel's sch_netem qdisc, which this kernel lacks")
    if not os.path.exists("/dev/net/tun"):
        raise RuntimeError("the fabric backend needs /dev/net/tun")
    return FabricBackend(layout, realtime=realtime)


def backend_by_name(name: str, layout: Layout) -> DelayBackend:
    """Gives a handle on the running backend `name` of an existing run (to update it, read stats or stop it)."""
    return TcBackend(layout) if name == "tc" else FabricBackend(layout)
