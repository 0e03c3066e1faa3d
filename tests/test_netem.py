"""netem on this machine: namespaces and links, measured RTTs and bandwidth, the CLI, and certain teardown.

Needs root, iproute2, network namespaces and /dev/net/tun; skipped with the reason where any is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from netem import netns
from netem.network import EmulatedNetwork, down, state_dir
from netem.probe import measure_rtts, measure_throughput_mbit, within_tolerance
from netem.tc import netem_available
from netem.topology import Topology, constant, uniform
from tests.netem_support import next_run_id, skip_reason
from tests.test_swarm_processes import LISTENER_HOLDER

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(skip_reason() is not None, reason=f"netem cannot run here: {skip_reason()}"),
]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def four_hosts() -> Iterator[EmulatedNetwork]:
    topology = uniform(4, min_ms=5, max_ms=80, seed=4)
    with EmulatedNetwork(topology, run_id=next_run_id()) as network:
        yield network


def root_links() -> list[str]:
    return sorted(line.split(":")[1].strip() for line in netns.ip("-o", "link", "show").splitlines())


def test_auto_backend_is_tc_only_where_the_kernel_has_netem(four_hosts: EmulatedNetwork) -> None:
    assert four_hosts.backend is not None
    expected = "tc" if netem_available(four_hosts.layout.hub) else "fabric"
    assert four_hosts.backend.name == expected
    if expected == "fabric":  # this machine: forcing tc must fail with the reason, and leave nothing behind
        run_id = next_run_id()
        with pytest.raises(RuntimeError, match="sch_netem"):
            EmulatedNetwork(constant(("a", "b"), 10), run_id=run_id, backend="tc").start()
        assert netns.list_namespaces(netns.run_prefix(run_id)) == []


def test_stopping_a_process_that_sigterm_ends_at_once_removes_its_private_socket_directory(
        four_hosts: EmulatedNetwork) -> None:
    # as a benchmark's client that printed `done` and is stopped while it shuts down: SIGTERM ends it before its exit
    # handlers remove the directory, and once it is gone its group has no process left to read it from
    run_id = next_run_id()
    holder = four_hosts.spawn(four_hosts.hosts[0], [sys.executable, "-c", LISTENER_HOLDER, run_id])
    holder.wait_for_line("ready", 30)
    held = list(Path(tempfile.gettempdir()).glob(f"pymp-{run_id}*"))
    assert len(held) == 1 and (held[0] / "listener-held").is_socket()
    assert holder.stop() == -signal.SIGTERM
    assert not held[0].exists()


def test_udp_echo_measures_each_pairs_rtt_within_tolerance(four_hosts: EmulatedNetwork) -> None:
    measurement = measure_rtts(four_hosts, proto="udp", count=15)
    print(measurement.table())
    assert measurement.lost == 0
    assert len(list(measurement.pairs())) == 6
    assert measurement.failures() == []


def test_tcp_echo_measures_each_pairs_rtt_within_tolerance(four_hosts: EmulatedNetwork) -> None:
    measurement = measure_rtts(four_hosts, proto="tcp", count=15)
    print(measurement.table())
    assert measurement.lost == 0
    assert measurement.failures() == []
    stats = four_hosts.backend_stats()
    if four_hosts.backend and four_hosts.backend.name == "fabric":
        print("fabric:", stats)
        lost = {key: stats[key] for key in ("foreign", "write_errors", "dropped_loss", "dropped_queue", "tun_dropped")}
        assert lost == dict.fromkeys(lost, 0)  # the fabric carried every packet


def test_delays_change_at_run_time(four_hosts: EmulatedNetwork) -> None:
    original = four_hosts.topology
    try:
        four_hosts.set_topology(original.scaled(0.25))
        measurement = measure_rtts(four_hosts, proto="udp", count=15, pairs=[(1, 0), (2, 3)])
        assert list(measurement.pairs()) == [(0, 1), (2, 3)]  # (1, 0) is the pair (0, 1)
        assert measurement.failures() == []
        assert measurement.measured_ms[0][1] < original.rtt_ms[0][1] * 0.5
    finally:
        four_hosts.set_topology(original)


def test_hosts_are_wired_only_inside_the_runs_namespaces() -> None:
    before = root_links()
    with EmulatedNetwork(constant(("a", "b", "c"), 4), run_id=next_run_id()) as network:
        assert root_links() == before  # nothing was added to the caller's namespace
        assert network.address("c") == "10.77.0.3"
        out = subprocess.run(network.command("c", ["ip", "-o", "-4", "addr", "show", "dev", "eth0"]),
                             capture_output=True, text=True, timeout=10, check=True).stdout
        assert "10.77.0.3/32" in out
        namespaces = netns.list_namespaces(netns.run_prefix(network.run_id))
        assert namespaces == sorted(network.layout.namespaces)
    assert netns.list_namespaces(netns.run_prefix(network.run_id)) == []
    assert root_links() == before


THROUGHPUT_TRIES = 3


def test_bulk_tcp_transfer_respects_the_configured_bandwidth() -> None:
    topology = Topology(("h0", "h1", "h2"), [[0, 20, 10], [20, 0, 30], [10, 30, 0]], {"h0": 20, "h2": 8})
    # Goodput counts TCP payload; the limit counts IP packets (~3.5% headers at full-size segments). No transfer may
    # pass its limit; one that falls short may have been starved of CPU by the machine's other work (a full test run
    # once measured 16.6 of 20 Mbit/s), so each link gets up to THROUGHPUT_TRIES transfers to reach it.
    with EmulatedNetwork(topology, run_id=next_run_id()) as network:
        for source, destination, limit in (("h0", "h1", 20), ("h1", "h2", 8)):  # h0 sends, h2 receives at most
            measured = []
            while len(measured) < THROUGHPUT_TRIES and (not measured or measured[-1] < 0.85 * limit):
                measured.append(measure_throughput_mbit(network, source, destination, seconds=2.5))
            print(f"{source}->{destination} {', '.join(f'{mbit:.2f}' for mbit in measured)} Mbit/s (limit {limit})")
            assert max(measured) <= 1.15 * limit
            assert measured[-1] >= 0.85 * limit


def test_cli_up_exec_ping_down(tmp_path: Path) -> None:
    topology_path = tmp_path / "t.json"
    topology_path.write_text(json.dumps({"hosts": ["h0", "h1", "h2"], "rtt_ms": [[0, 20, 40], [20, 0, 60],
                                                                                   [40, 60, 0]]}))
    cli = [sys.executable, "-m", "netem.cli"]
    run_id = next_run_id()
    try:
        up = subprocess.run([*cli, "up", "--topology", str(topology_path), "--run-id", run_id], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=True)
        assert up.stdout.strip() == run_id
        shown = subprocess.run([*cli, "exec", run_id, "h1", "--", "sh", "-c", "echo $NETEM_ADDRESS; ip -o -4 addr"],
                               cwd=REPO, capture_output=True, text=True, timeout=30, check=True).stdout
        assert shown.splitlines()[0] == "10.77.0.2" and "10.77.0.2/32" in shown
        out_json = tmp_path / "ping.json"
        ping = subprocess.run([*cli, "ping", run_id, "--json", str(out_json), "--count", "20"], cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=True)
        print(ping.stdout)
        result = json.loads(out_json.read_text())
        assert result["hosts"] == ["h0", "h1", "h2"]
        assert result["target_ms"] == [[0, 20, 40], [20, 0, 60], [40, 60, 0]]
        for i, j in ((0, 1), (0, 2), (1, 2)):
            assert within_tolerance(result["measured_ms"][i][j], result["target_ms"][i][j])
            assert result["measured_ms"][i][j] == result["measured_ms"][j][i]
        faster = tmp_path / "t2.json"
        faster.write_text(json.dumps({"hosts": ["h0", "h1", "h2"], "rtt_ms": [[0, 4, 8], [4, 0, 12], [8, 12, 0]]}))
        subprocess.run([*cli, "set", run_id, "--topology", str(faster)], cwd=REPO, capture_output=True, text=True,
                       timeout=30, check=True)
        subprocess.run([*cli, "ping", run_id, "--json", str(out_json), "--count", "5", "--proto", "tcp"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, check=True)
        result = json.loads(out_json.read_text())
        assert result["target_ms"][1][2] == 12
        assert all(within_tolerance(result["measured_ms"][i][j], result["target_ms"][i][j]) for i, j in ((0, 1),
                                                                                                         (1, 2)))
        assert run_id in subprocess.run([*cli, "list"], cwd=REPO, capture_output=True, text=True, timeout=30).stdout
        subprocess.run([*cli, "down", run_id], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
        assert netns.list_namespaces(netns.run_prefix(run_id)) == []
    finally:
        down(run_id)


# A process that starts one in a session of its own, which binds a socket in a private directory under the temporary
# directory and keeps no handler for SIGTERM, as a server starts torch's shared-memory manager
# (`torch-shm-dir-*/manager.sock`): stopping the spawned process's group leaves it to the namespaces' teardown.
SOCKET_HOLDER = textwrap.dedent("""
    import os, socket, sys, tempfile, time
    if os.fork() == 0:
        os.setsid()
        path = tempfile.mkdtemp(prefix="torch-shm-dir-" + sys.argv[1])
        held = socket.socket(socket.AF_UNIX)
        held.bind(path + "/manager.sock")
    time.sleep(300)
""")

CHILD = textwrap.dedent("""
    import glob, json, sys, tempfile, time
    from netem import netns
    from netem.network import EmulatedNetwork
    from netem.topology import constant
    mode, run_id, holder = sys.argv[1], sys.argv[2], sys.argv[3]
    with EmulatedNetwork(constant(("a", "b"), 10), run_id=run_id) as network:
        sleepers = [network.spawn("a", ["sleep", "300"]), network.spawn("b", [sys.executable, "-c", holder, run_id])]
        for _ in range(200):  # bounded: the holder binds its socket within seconds
            if glob.glob(f"{tempfile.gettempdir()}/torch-shm-dir-{run_id}*/manager.sock"):
                break
            time.sleep(0.05)
        # Whatever lives in the run's namespaces (the sleepers, and the fabric if that is the backend).
        pids = sorted({pid for namespace in network.layout.namespaces for pid in netns.namespace_pids(namespace)})
        assert {process.pid for process in sleepers} <= set(pids), pids
        if network.backend.name == "fabric":
            assert int((network.layout.state_dir / "fabric.pid").read_text()) in pids, pids
        print(json.dumps({"pids": pids}), flush=True)
        if mode == "raise":
            raise RuntimeError("a test failing midway")
        time.sleep(120)
""")


def start_child(mode: str, run_id: str) -> tuple[subprocess.Popen[str], list[int]]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode, run_id, SOCKET_HOLDER], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert child.stdout is not None
    line = child.stdout.readline()  # bounded: the child prints within seconds or dies (EOF)
    if not line:
        child.wait(timeout=30)
        raise AssertionError(f"child failed: {child.stderr.read() if child.stderr else ''}")
    return child, json.loads(line)["pids"]


def assert_nothing_left(run_id: str, pids: list[int], links_before: list[str]) -> None:
    assert netns.list_namespaces(netns.run_prefix(run_id)) == []
    # the socket the holder bound, with its private directory (SIGTERM gave it no chance to remove them)
    assert not list(Path(tempfile.gettempdir()).glob(f"torch-shm-dir-{run_id}*"))
    assert netns.wait_gone(pids, 5.0) == []
    assert root_links() == links_before
    assert not state_dir(run_id).exists()


def test_teardown_after_an_exception_midway_leaves_nothing() -> None:
    links, run_id = root_links(), next_run_id()
    child, pids = start_child("raise", run_id)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode != 0 and "a test failing midway" in stderr
    assert_nothing_left(run_id, pids, links)


def test_teardown_on_sigterm_leaves_nothing() -> None:
    links, run_id = root_links(), next_run_id()
    child, pids = start_child("wait", run_id)
    assert all(netns.is_alive(pid) for pid in pids) and netns.list_namespaces(netns.run_prefix(run_id))
    child.send_signal(signal.SIGTERM)
    child.communicate(timeout=60)
    assert child.returncode == 128 + signal.SIGTERM
    assert_nothing_left(run_id, pids, links)


def test_down_removes_what_a_killed_owner_left_behind() -> None:
    links, run_id = root_links(), next_run_id()
    child, pids = start_child("wait", run_id)
    child.kill()  # no handler runs: the namespaces, fabric and sleepers stay
    child.communicate(timeout=30)
    assert netns.list_namespaces(netns.run_prefix(run_id)) and all(netns.is_alive(pid) for pid in pids)
    done = subprocess.run([sys.executable, "-m", "netem.cli", "down", run_id], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    assert "removed 3 namespaces" in done.stdout
    assert_nothing_left(run_id, pids, links)
