"""Server lifecycle as processes: DHT expiry and rejoin, idle-session timeout, clean shutdown on SIGTERM."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from client import SwarmClient
from swarm.errors import SessionNotFound
from swarm.local_swarm import SwarmProcesses, threads_per_server
from swarm.model import resolve_model
from swarm.records import ServerRecord
from swarm.wire import encode_tensor

pytestmark = [pytest.mark.slow, pytest.mark.own_swarm]


def wait_until(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def online_peers(client: SwarmClient) -> dict[str, ServerRecord]:
    return client.run(client.servers(), timeout=30)


def socket_files(pid: int) -> set[str]:
    """Gives the paths of the Unix sockets that process `pid` and its children are bound to (the p2p daemons' and
    their clients' files, torch's shared-memory manager's)."""
    process = psutil.Process(pid)
    return {c.laddr for p in (process, *process.children(recursive=True))
            for c in p.net_connections(kind="unix") if c.laddr and not c.laddr.startswith("\0")}


def test_dead_server_vanishes_within_its_ttl_and_rejoins_with_the_same_identity(
    swarm_factory: SwarmProcesses, tiny_llama: Path, tmp_path: Path
) -> None:
    swarm_factory.start_dht()
    identity = tmp_path / "server.id"
    args = ("--identity", str(identity))
    first = swarm_factory.start_server(tiny_llama, "0:8", *args)
    source = resolve_model(str(tiny_llama))
    client = SwarmClient(source.model_id, source.num_blocks, swarm_factory.initial_peers)
    try:
        assert first.peer_id in online_peers(client)
        sockets = socket_files(first.popen.pid)
        assert len(sockets) >= 3, sockets  # its DHT node's daemon and client, and the server's own p2p client
        swarm_factory.kill(first, signal.SIGKILL)
        wait_until(lambda: not [path for path in sockets if os.path.exists(path)], 10, "no socket file is left")
        # --record-ttl is 4 s in the harness; allow for DHT clock slack and a loaded machine
        wait_until(lambda: first.peer_id not in online_peers(client), 20, "the killed server left the DHT")
        second = swarm_factory.start_server(tiny_llama, "0:8", *args)
        assert second.peer_id == first.peer_id
        wait_until(lambda: first.peer_id in online_peers(client), 20, "the restarted server is back")
    finally:
        client.shutdown()


def test_idle_session_times_out_and_frees_its_pages_then_sigterm_shuts_down_cleanly(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    swarm_factory.start_dht()
    server = swarm_factory.start_server(tiny_llama, "0:8", "--session-timeout", "2", "--drain-timeout", "5",
                                         "--page-size", "2KB")
    source = resolve_model(str(tiny_llama))
    client = SwarmClient(source.model_id, source.num_blocks, swarm_factory.initial_peers)
    try:
        (record,) = online_peers(client).values()
        connection = client.run(client.connect(record))

        def call(method: str, payload: dict) -> dict:  # type: ignore[type-arg]
            return client.run(connection.call(method, payload, timeout=30))

        def pages_kv() -> int:
            return call("info", {})["record"]["pages_kv"]

        session_id = call("open", {"blocks": [0, 8], "max_length": 32})["session_id"]
        call("step", {"session_id": session_id, "hidden": encode_tensor(torch.ones(1, 3, 64))})
        assert pages_kv() > 0
        wait_until(lambda: pages_kv() == 0, 20, "the idle session was freed")
        with pytest.raises(SessionNotFound):
            call("step", {"session_id": session_id, "hidden": encode_tensor(torch.ones(1, 1, 64))})

        # an open session at shutdown is freed too; before its first step its record counts its announced prompt
        call("open", {"blocks": [0, 8], "max_length": 32, "prompt_tokens": 20})
        record = call("info", {})["record"]
        tokens_per_page = record["page_bytes"] // record["kv_bytes_per_token"]
        assert tokens_per_page < 20, record  # the prompt takes more than the page a session opens with per block
        assert (record["pages_kv"], record["kv_packed_pages"]) == (8, 8 * math.ceil(20 / tokens_per_page))
        sockets = socket_files(server.popen.pid)
        assert len(sockets) >= 3, sockets  # its DHT node's daemon and client, and the server's own p2p client
        os.kill(server.popen.pid, signal.SIGTERM)  # as `kill PID` does
        assert server.popen.wait(timeout=60) == 0
        # torch's shared-memory manager outlives its last client by up to 2 s, then removes its own
        wait_until(lambda: not [path for path in sockets if os.path.exists(path)], 10, "no socket file is left")
        log = server.output()
        assert "Signal received: draining" in log and "freed 1 open session(s)" in log and "Traceback" not in log
        wait_until(
            lambda: all(r.state != "online" for r in online_peers(client).values()), 20, "the record says draining"
        )
    finally:
        client.shutdown()


def test_servers_on_one_machine_split_its_cores() -> None:
    assert threads_per_server(3, cores=2) == 1
    assert threads_per_server(2, cores=2) == 1
    assert threads_per_server(1, cores=2) == 2
    assert threads_per_server(3, cores=16) == 5
    assert threads_per_server(0, cores=4) == 4
