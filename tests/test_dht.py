"""Announce and discover over real hivemind DHTs on loopback: per-block keys, validation, expiry, refresh, swarm-dht."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hivemind
import pytest
from hivemind.utils import get_dht_time

from swarm.dht import Announcer, announce, block_key, lookup, lookup_async
from swarm.records import ServerRecord, ServerState
from swarm.signing import open_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
REPO_ROOT = Path(__file__).resolve().parents[1]
EXPIRY_POLL_LIMIT_S = 15.0
PROCESS_WAIT_S = 30.0


def make_record(peer_id: str, model_id: str, block_start: int, block_end: int, **overrides: Any) -> ServerRecord:
    """Gives a valid record for `peer_id` hosting blocks [block_start, block_end) of `model_id`."""
    fields: dict[str, Any] = {
        "peer_id": peer_id,
        "model_id": model_id,
        "block_start": block_start,
        "block_end": block_end,
        "state": ServerState.online,
        "pages_total": 10,
        "pages_params": 4,
        "pages_kv": 2,
        "pages_free": 4,
        "sessions_fit": 1,
        "page_bytes": 1 << 20,
        "kv_bytes_per_token": 1536,
        "block_compute_ms": 1.5,
        "network_mbps": None,
        "session_count": 0,
        "max_length": 2048,
        "dtype": "float32",
        "quant": "none",
        "version": "0.0.0",
        "public_name": None,
        "addrs": [],
    }
    fields.update(overrides)
    return ServerRecord(**fields)


def peers_by_block(records_by_block: list[dict[str, ServerRecord]]) -> list[set[str]]:
    return [set(records) for records in records_by_block]


@pytest.fixture(scope="module")
def dht_pair() -> Iterator[tuple[hivemind.DHT, hivemind.DHT]]:
    """Gives two joined DHT nodes on loopback; each test uses its own model id so they share them safely."""
    nodes: list[hivemind.DHT] = []
    try:
        nodes.append(hivemind.DHT(start=True, host_maddrs=LOOPBACK))
        initial_peers = [str(maddr) for maddr in nodes[0].get_visible_maddrs()]
        nodes.append(hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=initial_peers))
        yield nodes[0], nodes[1]
    finally:
        for node in nodes:
            node.shutdown()


def test_announce_then_lookup_finds_record_under_each_hosted_block_only(
    dht_pair: tuple[hivemind.DHT, hivemind.DHT],
) -> None:
    first, second = dht_pair
    model_id = "test/announce-lookup"
    assert announce(second, make_record("peer-a", model_id, 1, 3), ttl_s=60)
    assert announce(first, make_record("peer-b", model_id, 2, 5), ttl_s=60)

    found = lookup(first, model_id, num_blocks=6)
    assert peers_by_block(found) == [set(), {"peer-a"}, {"peer-a", "peer-b"}, {"peer-b"}, {"peer-b"}, set()]
    assert found[2]["peer-a"] == make_record("peer-a", model_id, 1, 3)
    assert peers_by_block(lookup(second, "test/other-model", num_blocks=6)) == [set()] * 6


def test_lookup_drops_garbage_and_records_under_the_wrong_key(dht_pair: tuple[hivemind.DHT, hivemind.DHT]) -> None:
    first, second = dht_pair
    model_id = "test/garbage"
    expiration_time = get_dht_time() + 60
    key0 = block_key(model_id, 0)
    assert announce(second, make_record("honest", model_id, 0, 2), ttl_s=60)
    assert first.store(key0, b"\x00garbage", expiration_time, subkey="garbage")
    assert first.store(key0, {"peer_id": "half-a-record"}, expiration_time, subkey="half-a-record")
    # A valid record for blocks 2..3, stored under block 0: it must not show up there.
    misplaced = make_record("misplaced", model_id, 2, 4)
    assert first.store(key0, misplaced.to_wire(), expiration_time, subkey="misplaced")
    # One peer announcing another: the subkey does not match the record's peer id.
    assert first.store(key0, make_record("victim", model_id, 0, 1).to_wire(), expiration_time, subkey="impostor")
    assert first.store(
        key0, make_record("other-model", "test/else", 0, 1).to_wire(), expiration_time, subkey="other-model"
    )
    # A plain value (no subkeys) where a subkey dictionary belongs.
    assert first.store(block_key(model_id, 3), ["not", "a", "dictionary"], expiration_time)

    found = lookup(first, model_id, num_blocks=4)
    assert peers_by_block(found) == [{"honest"}, {"honest"}, set(), set()]


def test_record_expires_without_refresh_and_reappears_after_rejoin(
    dht_pair: tuple[hivemind.DHT, hivemind.DHT],
) -> None:
    first, second = dht_pair
    model_id = "test/expiry"
    record = make_record("short-lived", model_id, 0, 2)
    assert announce(second, record, ttl_s=2.0)
    assert peers_by_block(lookup(first, model_id, num_blocks=2)) == [{"short-lived"}, {"short-lived"}]

    deadline = time.monotonic() + EXPIRY_POLL_LIMIT_S
    while peers_by_block(lookup(first, model_id, num_blocks=2)) != [set(), set()]:
        assert time.monotonic() < deadline, "record did not expire"
        time.sleep(0.5)

    assert announce(second, record, ttl_s=60)
    assert peers_by_block(lookup(first, model_id, num_blocks=2)) == [{"short-lived"}, {"short-lived"}]


def test_announcer_keeps_record_alive_retracts_dropped_blocks_and_drains_on_stop(
    dht_pair: tuple[hivemind.DHT, hivemind.DHT],
) -> None:
    first, second = dht_pair
    model_id = "test/announcer"
    current = {"record": make_record("refreshed", model_id, 0, 3)}

    async def scenario() -> None:
        announcer = Announcer(second, lambda: current["record"], period_s=0.3, ttl_s=2.0, drain_ttl_s=1.0)
        assert await announcer.start()
        try:
            # Well past the ttl: only the refresh task can keep the record visible.
            await asyncio.sleep(5.0)
            found = await lookup_async(first, model_id, num_blocks=3)
            assert peers_by_block(found) == [{"refreshed"}] * 3

            # Dropping block 2: the old entry there must stop routing clients at once, not at expiry.
            current["record"] = make_record("refreshed", model_id, 0, 2, session_count=1)
            assert await announcer.announce_now()
            found = await lookup_async(first, model_id, num_blocks=3)
            assert peers_by_block(found) == [{"refreshed"}, {"refreshed"}, set()]
            assert found[0]["refreshed"].session_count == 1
        finally:
            await announcer.stop(drain=True)
        found = await lookup_async(first, model_id, num_blocks=2)
        assert [records["refreshed"].state for records in found] == [ServerState.draining] * 2

    asyncio.run(scenario())


def test_announcer_rejects_a_period_that_lets_the_record_lapse(dht_pair: tuple[hivemind.DHT, hivemind.DHT]) -> None:
    with pytest.raises(ValueError, match="period_s < ttl_s"):
        Announcer(dht_pair[0], lambda: make_record("p", "m", 0, 1), period_s=5.0, ttl_s=5.0)


def _read_initial_peers(process: subprocess.Popen[str]) -> list[str]:
    """Gives the multiaddrs from swarm-dht's `initial_peers:` line, waiting a bounded time."""
    assert process.stdout is not None
    deadline = time.monotonic() + PROCESS_WAIT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if not ready:
            assert process.poll() is None, f"swarm-dht exited early with code {process.returncode}"
            continue
        line = process.stdout.readline()
        assert line, f"swarm-dht closed stdout (exit code {process.poll()})"
        if line.startswith("initial_peers: "):
            return line.removeprefix("initial_peers: ").split()
    raise AssertionError("swarm-dht printed no initial_peers line in time")


def _start_swarm_dht(identity_path: Path, stderr_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with stderr_path.open("a") as stderr_file:
        return subprocess.Popen(
            [sys.executable, "-m", "swarm.dht_cli", "--host", "127.0.0.1", "--identity", str(identity_path)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr_file,
            text=True,
        )


def _stop(process: subprocess.Popen[str], signum: int) -> int:
    process.send_signal(signum)
    try:
        return process.wait(timeout=PROCESS_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


def test_swarm_dht_process_bootstraps_a_swarm_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    identity_path = tmp_path / "bootstrap.key"
    stderr_path = tmp_path / "swarm-dht.stderr"
    process = _start_swarm_dht(identity_path, stderr_path)
    joiners: list[hivemind.DHT] = []
    try:
        initial_peers = _read_initial_peers(process)
        assert initial_peers and all("/p2p/" in maddr for maddr in initial_peers)
        assert identity_path.is_file()

        for _ in range(2):  # the swarm's nodes keep only records a value's peer signed under its own subkey
            joiners.append(open_dht(host_maddrs=LOOPBACK, initial_peers=initial_peers))
        writer = joiners[0].peer_id.to_base58()
        record = make_record(writer, "cli-test-model", 0, 2).to_wire()
        assert joiners[0].store("cli-test-key", record, get_dht_time() + 60, subkey=writer)
        assert not joiners[0].store("cli-test-key", "not a record", get_dht_time() + 90, subkey=writer)
        found = joiners[1].get("cli-test-key", latest=True)
        assert found is not None and found.value[writer].value == record
    finally:
        for joiner in joiners:
            joiner.shutdown()
        exit_code = _stop(process, signal.SIGTERM)
    assert exit_code == 0, stderr_path.read_text()[-2000:]

    # The identity file makes the peer id stable across restarts; SIGINT ends it just as cleanly.
    restarted = _start_swarm_dht(identity_path, stderr_path)
    try:
        restarted_peers = _read_initial_peers(restarted)
    finally:
        exit_code = _stop(restarted, signal.SIGINT)
    assert exit_code == 0, stderr_path.read_text()[-2000:]
    assert {maddr.rsplit("/p2p/", 1)[1] for maddr in restarted_peers} == {
        maddr.rsplit("/p2p/", 1)[1] for maddr in initial_peers
    }
