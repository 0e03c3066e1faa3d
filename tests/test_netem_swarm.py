"""A swarm across emulated WAN links: DHT, 3 servers and the client each in its own namespace, RTTs derived from
RIPE Atlas (or, where that data is missing, a seeded random-geometric matrix); greedy tokens equal the local
model's and every decode step takes at least what the delays imply.

Only physical lower bounds are asserted, never a speed. A decode step must cross the chain:
- without push the client calls each server in turn: step >= sum_k RTT(client, s_k);
- with push the token goes client -> s1 -> s2 -> s3 -> client: step >= (RTT(c, s1) + RTT(s1, s2) + RTT(s2, s3)
  + RTT(s3, c)) / 2.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from netem import ripe
from netem.network import EmulatedNetwork
from netem.probe import measure_rtts
from netem.topology import Topology, random_geometric
from swarm.local_swarm import SwarmProcesses
from tests.netem_support import next_run_id, skip_reason, wait_for_quiet_cpu

RIPE_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "ripe_atlas_eu_rtt.csv"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(skip_reason() is not None, reason=f"netem cannot run here: {skip_reason()}"),
]
HOSTS = ["dht", "s0", "s1", "s2", "client"]
SERVERS = {"s0": "0:3", "s1": "3:6", "s2": "6:8"}
NEW_TOKENS = 8
CLIENT_TIMEOUT_S = 180.0
CLOCK_SLACK_MS = 0.05  # the client's timestamps and the fabric's deadlines come from the same clock; rounding only


def base_topology() -> Topology:
    """Gives the RIPE-derived matrix of the test's hosts, or a seeded random-geometric one of similar RTTs."""
    if RIPE_DATA.is_file():
        return ripe.from_ripe_atlas(len(HOSTS), seed=3, path=RIPE_DATA, hosts=HOSTS)
    return random_geometric(len(HOSTS), min_ms=5.0, max_ms=40.0, seed=3, hosts=HOSTS)


def decode_bounds_ms(topology: Topology, chain: list[str]) -> tuple[float, float]:
    """Gives the least time a decode step can take through `chain`: (round trip per span, server push)."""
    per_span = sum(topology.rtt("client", server) for server in chain)
    path = ["client", *chain, "client"]
    push = sum(topology.rtt(a, b) for a, b in itertools.pairwise(path)) / 2
    return per_span, push


@pytest.fixture(scope="module")
def wan_swarm(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[tuple]:
    topology = base_topology()
    workdir = tmp_path_factory.mktemp("netem-swarm")
    # Exits in reverse: the client, then the swarm drains over the still-running network, then the network goes.
    with EmulatedNetwork(topology, run_id=next_run_id()) as network, SwarmProcesses(workdir) as swarm:
        swarm.start_dht(host=network.address("dht"), launcher=network.command("dht", []))
        procs = {
            host: swarm.start_server(tiny_llama, blocks, wait=False, name=host, host=network.address(host),
                                     launcher=network.command(host, []))
            for host, blocks in SERVERS.items()
        }
        for proc in procs.values():
            swarm.wait_ready(proc)
        client = network.spawn(
            "client", [sys.executable, "-m", "tests.netem_client", "--model", str(tiny_llama), "--initial-peers",
                       *swarm.initial_peers], name="client", log_dir=workdir, interactive=True,
            env={"OMP_WAIT_POLICY": "PASSIVE"},
        )
        try:
            ready = client.read_line(CLIENT_TIMEOUT_S)
            assert ready == '{"ready": true}', ready
            hosts_by_peer = {proc.peer_id: host for host, proc in procs.items()}
            yield network, client, hosts_by_peer
        finally:
            client.stop()


def test_measured_rtts_match_the_matrix(wan_swarm: tuple) -> None:
    network, _, _ = wan_swarm
    busy_pct = wait_for_quiet_cpu()  # the swarm and the client have just started
    measurement = measure_rtts(network, proto="udp", count=15)
    print(f"RTTs {network.topology.source} (CPUs {busy_pct:.0f}% busy before)\n{measurement.table()}")
    assert measurement.failures() == []


@pytest.mark.parametrize(("rtt_scale", "server_push"), [(1.0, True), (3.0, True), (3.0, False)])
def test_generate_across_namespaces_matches_local_and_pays_the_path_rtts(
    wan_swarm: tuple, tiny_llama: Path, rtt_scale: float, server_push: bool
) -> None:
    network, client, hosts_by_peer = wan_swarm
    topology = base_topology().scaled(rtt_scale)
    network.set_topology(topology)
    input_ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(int(rtt_scale)))
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    expected = local.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)

    request = {"op": "generate", "input_ids": input_ids.tolist(), "max_new_tokens": NEW_TOKENS,
               "server_push": server_push}
    reply = client.request(request, CLIENT_TIMEOUT_S)
    assert "error" not in reply, reply["error"]
    assert reply["tokens"] == expected.tolist()

    chain = [hosts_by_peer[peer] for peer in reply["route"]]
    assert chain == ["s0", "s1", "s2"]
    per_span_ms, push_ms = decode_bounds_ms(topology, chain)
    steps = sorted(reply["step_ms"])
    print(
        f"RTTs x{rtt_scale:g}, server_push={server_push}: decode step min {steps[0]:.1f} / median "
        f"{steps[len(steps) // 2]:.1f} ms; lower bounds: round trip per span {per_span_ms:.1f} ms, server push "
        f"{push_ms:.1f} ms; prefill {reply['prefill_ms']:.1f} ms"
    )
    assert len(steps) == NEW_TOKENS - 1
    assert steps[0] >= (push_ms if server_push else per_span_ms) - CLOCK_SLACK_MS


def test_per_token_latency_rises_with_the_paths_rtts(wan_swarm: tuple) -> None:
    network, client, hosts_by_peer = wan_swarm
    input_ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(7))
    medians_ms, bounds_ms = {}, {}
    for scale in (1.0, 3.0):
        topology = base_topology().scaled(scale)
        network.set_topology(topology)
        reply = client.request({"op": "generate", "input_ids": input_ids.tolist(), "max_new_tokens": NEW_TOKENS,
                                "server_push": True}, CLIENT_TIMEOUT_S)
        assert "error" not in reply, reply["error"]
        medians_ms[scale] = statistics.median(reply["step_ms"])
        bounds_ms[scale] = decode_bounds_ms(topology, [hosts_by_peer[peer] for peer in reply["route"]])[1]
    print(f"median decode step: {medians_ms}; push bounds: {bounds_ms}")
    # Tripling every RTT adds twice the path's delay to each step; compute and overheads stay. A quarter of the
    # added delay is left to absorb what overheads the first run had on top of its bound.
    assert medians_ms[3.0] - medians_ms[1.0] >= 0.75 * (bounds_ms[3.0] - bounds_ms[1.0])
