"""The live orchestrator: servers without --blocks follow its placement, sessions get chains by JFFC with leases, and
a server follows no one but the orchestrator it names."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import ClientConfig, DistributedModelForCausalLM
from swarm.dht import lookup_orchestrators_async
from swarm.errors import AssignmentRefused
from swarm.local_swarm import SwarmProcesses
from swarm.records import ServerRecord, active_orchestrator
from swarm.rpc import dial

pytestmark = pytest.mark.slow
TIMEOUT_S = 30.0
# 64 KiB pages: a tiny-Llama block takes 3, a session's KV one per block; 24 pages hold 4 to 6 blocks with room for KV.
SERVER_ARGS = ("--memory", "1536KiB", "--page-size", "64KiB")
ORCHESTRATOR_ARGS = ("--refresh-period", "0.5", "--lease-ttl", "3", "--prior-rate", "0.5")


def prompt(seed: int, length: int = 9) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def orchestrator_state(model: DistributedModelForCausalLM) -> dict[str, Any]:
    """Gives the active orchestrator's `plan` reply, asked over the client's own DHT node."""
    client = model.swarm

    async def ask() -> dict[str, Any]:
        records = await lookup_orchestrators_async(client.dht, client.model_id, timeout_s=TIMEOUT_S)
        active = active_orchestrator(records)
        assert active is not None, "no orchestrator announced"
        connection = await dial(client.p2p, active.peer_id, list(active.addrs), timeout=TIMEOUT_S)
        try:
            return await connection.call("plan", {}, timeout=TIMEOUT_S)
        finally:
            await connection.close()

    return client.run(ask(), timeout=2 * TIMEOUT_S)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def covers_every_block(state: dict[str, Any], num_blocks: int) -> bool:
    blocks = {block for start, end in state["blocks"].values() for block in range(start, end)}
    return blocks == set(range(num_blocks)) and bool(state["chains"])


@pytest.fixture(scope="module")
def llama_local(tiny_llama: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def orchestrated(swarm_factory: SwarmProcesses, tiny_llama: Path) -> Iterator[DistributedModelForCausalLM]:
    swarm_factory.start_dht()
    orchestrator = swarm_factory.start_orchestrator(tiny_llama, *ORCHESTRATOR_ARGS)
    for _ in range(3):
        swarm_factory.start_server(tiny_llama, None, "--orchestrator", orchestrator.peer_id, *SERVER_ARGS)
    model = DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama), initial_peers=swarm_factory.initial_peers, client_config=ClientConfig(orchestrator="auto")
    )
    try:
        wait_for(lambda: covers_every_block(orchestrator_state(model), 8), "a plan covering every block")
        yield model
    finally:
        model.shutdown()


def test_servers_without_blocks_follow_the_plan_and_sessions_get_chains_by_jffc(
    orchestrated: DistributedModelForCausalLM, llama_local: AutoModelForCausalLM, swarm_factory: SwarmProcesses,
    tiny_llama: Path, tmp_path: Path,
) -> None:
    before = orchestrator_state(orchestrated)
    for seed in (1, 2):
        input_ids = prompt(seed)
        expected = llama_local.generate(input_ids, max_new_tokens=12, do_sample=False)
        actual = orchestrated.generate(input_ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(actual, expected), seed
    with orchestrated.inference_session(max_length=32, prompt_tokens=9) as session:
        orchestrated.generate(prompt(3), session=session, max_new_tokens=2, do_sample=False)
        state = orchestrator_state(orchestrated)
        leased = [chain for chain in state["chains"] if chain["in_use"] == 1]
        assert len(leased) == 1 and [span.peer_id for span in session.route] == leased[0]["servers"]
    after = orchestrator_state(orchestrated)
    assert after["dispatched"] == before["dispatched"] + 3 and after["leases"] == 0

    path = tmp_path / "plan.json"
    code, output = swarm_factory.run_to_exit(
        ["-m", "orchestrator.service.cli", "plan", "--model", str(tiny_llama), "--initial-peers",
         *swarm_factory.initial_peers, "--json", str(path)]
    )
    assert code == 0, output
    plan = json.loads(path.read_text())
    assert {"c", "method", "blocks", "chains", "arrival_rate", "queued", "dispatched", "bounds"} <= set(plan)
    assert covers_every_block(plan, 8) and plan["dispatched"] >= 3 and plan["c"] >= 1
    assert all({"servers", "capacity", "in_use", "service_time_ms"} <= set(chain) for chain in plan["chains"])
    assert "| chain |" in output


def test_a_server_follows_only_the_orchestrator_it_names(
    orchestrated: DistributedModelForCausalLM, swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    client = orchestrated.swarm
    follower = next(iter(orchestrator_state(orchestrated)["blocks"]))
    independent = swarm_factory.start_server(tiny_llama, "0:2", *SERVER_ARGS)

    def assign(peer_id: str) -> None:
        async def call() -> None:
            records = await client.servers()
            record: ServerRecord = records[peer_id]
            connection = await dial(client.p2p, peer_id, list(record.addrs), timeout=TIMEOUT_S)
            try:
                await connection.call("assign", {"blocks": [0, 8]}, timeout=TIMEOUT_S)
            finally:
                await connection.close()

        client.run(call(), timeout=2 * TIMEOUT_S)

    wait_for(lambda: independent.peer_id in client.run(client.servers()), "the independent server's record")
    with pytest.raises(AssignmentRefused, match="names no orchestrator"):
        assign(independent.peer_id)
    with pytest.raises(AssignmentRefused, match="follows orchestrator"):
        assign(follower)
