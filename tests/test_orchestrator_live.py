"""The live orchestrator: servers without --blocks follow its placement, sessions get chains by JFFC with leases, and
a server follows no one but the orchestrator it names."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from api.swarm_view import SwarmWatcher
from client import ClientConfig, DistributedModelForCausalLM
from swarm.dht import lookup_orchestrators_async
from swarm.errors import AssignmentRefused
from swarm.local_swarm import Proc, SwarmProcesses
from swarm.records import ServerRecord, active_orchestrator
from swarm.rpc import dial
from tests.prometheus import metrics_url, scrape, value
from tests.test_failover import ActAfterTokens

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
def orchestrators(swarm_factory: SwarmProcesses, tiny_llama: Path) -> list[Proc]:
    """The active orchestrator and its standby (started later), both named by every following server."""
    swarm_factory.start_dht()
    active = swarm_factory.start_orchestrator(tiny_llama, *ORCHESTRATOR_ARGS, "--metrics-port", "0",
                                              name="orchestrator-active")
    standby = swarm_factory.start_orchestrator(tiny_llama, *ORCHESTRATOR_ARGS, name="orchestrator-standby")
    return [active, standby]


def start_follower(swarm: SwarmProcesses, model: Path, orchestrators: list[Proc], *, wait: bool = True) -> Proc:
    return swarm.start_server(model, None, "--orchestrator", *(o.peer_id for o in orchestrators), *SERVER_ARGS,
                              wait=wait)


@pytest.fixture(scope="module")
def orchestrated(
    swarm_factory: SwarmProcesses, tiny_llama: Path, orchestrators: list[Proc]
) -> Iterator[DistributedModelForCausalLM]:
    for follower in [start_follower(swarm_factory, tiny_llama, orchestrators, wait=False) for _ in range(3)]:
        swarm_factory.wait_started(follower)  # the three start side by side
    model = DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama), initial_peers=swarm_factory.initial_peers, client_config=ClientConfig(orchestrator="auto")
    )
    try:
        wait_for(lambda: covers_every_block(orchestrator_state(model), 8), "a plan covering every block")
        yield model
    finally:
        model.shutdown()


@pytest.fixture(scope="module")
def api_url(swarm_factory: SwarmProcesses, tiny_llama: Path, orchestrated: DistributedModelForCausalLM) -> str:
    """A swarm-api for the tiny model (its checkpoint has a character tokenizer) whose requests wait 1 s at most."""
    _proc, url = swarm_factory.start_api(tiny_llama, "--route-wait", "1")
    return url


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


HOLDER = """
import sys, time
from client import DistributedModelForCausalLM
model = DistributedModelForCausalLM.from_pretrained(sys.argv[1], initial_peers=sys.argv[2:])
session = model.inference_session(max_length=32, prompt_tokens=4)
print("holding", flush=True)
time.sleep(600)
"""


def test_a_session_waits_in_the_queue_while_every_slot_is_taken_and_a_dead_clients_lease_expires(
    orchestrated: DistributedModelForCausalLM, swarm_factory: SwarmProcesses, tiny_llama: Path,
    orchestrators: list[Proc], api_url: str, llama_local: AutoModelForCausalLM,
) -> None:
    """... and swarm-api answers 503 with Retry-After when its request waited 1 s in the full queue, then, once
    chains are free, the local model's greedy text through a leased chain."""
    state = orchestrator_state(orchestrated)
    slots = sum(chain["capacity"] for chain in state["chains"])
    holder = swarm_factory.run_in_background(["-c", HOLDER, str(tiny_llama), *swarm_factory.initial_peers])
    sessions = []
    try:
        swarm_factory.wait_for_line(holder, "holding")
        sessions = [orchestrated.inference_session(max_length=32, prompt_tokens=4) for _ in range(slots - 1)]
        assert orchestrator_state(orchestrated)["leases"] == slots
        queued: list[object] = []
        waiter = threading.Thread(
            target=lambda: queued.append(orchestrated.inference_session(max_length=32, prompt_tokens=4)), daemon=True
        )
        waiter.start()
        wait_for(lambda: orchestrator_state(orchestrated)["queued"] == 1, "the session to queue")
        full = httpx.post(f"{api_url}/v1/completions", timeout=TIMEOUT_S,
                          json={"model": str(tiny_llama), "prompt": "Hi", "max_tokens": 2})
        assert full.status_code == 503 and full.headers["retry-after"], full.text
        assert full.json()["error"]["code"] == "no_capacity" and "stayed full" in full.json()["error"]["message"]
        assert not queued, "a session started although every slot was taken"
        metrics = scrape(metrics_url(swarm_factory, orchestrators[0]))  # Prometheus sees what `info` says
        state = orchestrator_state(orchestrated)
        assert value(metrics, "chainswarm_orchestrator_queue_length") == 1
        assert value(metrics, "chainswarm_orchestrator_leases") == slots
        assert value(metrics, "chainswarm_orchestrator_dispatches_total") == state["dispatched"]
        assert value(metrics, "chainswarm_orchestrator_active") == 1
        assert sum(value(metrics, "chainswarm_orchestrator_chain_in_use", chain=str(index))
                   for index in range(len(state["chains"]))) == slots
        watcher = SwarmWatcher(orchestrated.swarm, "tiny")  # what the live page shows of the orchestrator
        asyncio.run(watcher.refresh())
        view = watcher.view()
        assert view["orchestrator"]["queued"] == 1 and min(view["coverage"]) >= 1
        assert [(chain["capacity"], chain["in_use"]) for chain in view["chains"]] == [
            (chain["capacity"], chain["in_use"]) for chain in state["chains"]]
        swarm_factory.kill(holder)  # its lease is no longer renewed: it expires within the lease TTL (3 s)
        waiter.join(timeout=60)
        assert queued, "the queued session did not get the freed slot"
        sessions.append(queued[0])  # type: ignore[arg-type]
        final = orchestrator_state(orchestrated)
        assert final["queued"] == 0 and final["leases"] == slots
    finally:
        for session in sessions:
            session.close()  # type: ignore[attr-defined]
    wait_for(lambda: orchestrator_state(orchestrated)["leases"] == 0, "every lease to be released")

    dispatched = orchestrator_state(orchestrated)["dispatched"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tokenizer("The swarm")["input_ids"]
    expected = llama_local.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
    reply = httpx.post(f"{api_url}/v1/completions", timeout=TIMEOUT_S,
                       json={"model": str(tiny_llama), "prompt": "The swarm", "max_tokens": 6, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert orchestrator_state(orchestrated)["dispatched"] == dispatched + 1  # the API's session took a leased chain


def test_a_server_joins_one_leaves_the_orchestrator_replans_and_sessions_fail_over_exactly(
    orchestrated: DistributedModelForCausalLM, llama_local: AutoModelForCausalLM, swarm_factory: SwarmProcesses,
    tiny_llama: Path, orchestrators: list[Proc],
) -> None:
    before = orchestrator_state(orchestrated)
    joined = start_follower(swarm_factory, tiny_llama, orchestrators)
    wait_for(lambda: joined.peer_id in orchestrator_state(orchestrated)["blocks"], "a plan with the new server")
    replanned = orchestrator_state(orchestrated)
    kept = {peer: span for peer, span in before["blocks"].items() if replanned["blocks"].get(peer) == span}
    assert kept == before["blocks"], "the re-plan moved servers it did not need to move"
    assert covers_every_block(replanned, 8)

    by_peer = {proc.peer_id: proc for proc in swarm_factory.procs if proc.name.startswith("server-auto")}
    input_ids = prompt(7, 10)
    expected = llama_local.generate(input_ids, max_new_tokens=16, do_sample=False)
    left: list[str] = []
    with orchestrated.inference_session(max_length=64, prompt_tokens=10) as session:

        def leave() -> None:
            peer_id = session.route[-1].peer_id
            left.append(peer_id)
            swarm_factory.kill(by_peer[peer_id], signal.SIGKILL)
            by_peer[peer_id].popen.wait(timeout=30)

        actual = orchestrated.generate(input_ids, session=session, max_new_tokens=16, do_sample=False,
                                       streamer=ActAfterTokens({4: leave}))
        assert session.failovers >= 1 and left[0] not in {span.peer_id for span in session.route}
    assert actual.tolist() == expected.tolist()
    wait_for(lambda: left[0] not in orchestrator_state(orchestrated)["blocks"], "a re-plan without the lost server")
    after = orchestrator_state(orchestrated)
    assert covers_every_block(after, 8)
    if after["c"] == replanned["c"]:  # the servers left still cover every block: nothing needs to move
        assert after["blocks"] == {peer: span for peer, span in replanned["blocks"].items() if peer != left[0]}


def test_with_the_orchestrator_killed_clients_fall_back_and_the_standby_takes_over(
    orchestrated: DistributedModelForCausalLM, llama_local: AutoModelForCausalLM, swarm_factory: SwarmProcesses,
    orchestrators: list[Proc],
) -> None:
    active, standby = orchestrators
    assert orchestrator_state(orchestrated)["orchestrator"] == active.peer_id
    swarm_factory.kill(active)
    active.popen.wait(timeout=30)
    input_ids = prompt(11)
    expected = llama_local.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert orchestrated.generate(input_ids, max_new_tokens=8, do_sample=False).tolist() == expected.tolist()

    def standby_serves() -> bool:
        try:
            state = orchestrator_state(orchestrated)
        except Exception:  # the dead one's record may still be found until it expires
            return False
        return state["orchestrator"] == standby.peer_id and state["active"] and covers_every_block(state, 8)

    wait_for(standby_serves, "the standby to take over")
    dispatched = orchestrator_state(orchestrated)["dispatched"]
    assert orchestrated.generate(input_ids, max_new_tokens=8, do_sample=False).tolist() == expected.tolist()
    assert orchestrator_state(orchestrated)["dispatched"] == dispatched + 1
