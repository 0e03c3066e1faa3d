"""Live KV migration: a session's KV moves to a peer hosting the same blocks mid-generation, the session goes on
there without a replay, greedy tokens stay those of the local model, and both pools return to their baselines."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import ClientConfig, DistributedModelForCausalLM
from client.swarm_client import SwarmClient
from swarm.errors import MaxLengthExceeded, MigrationRefused, SessionNotFound, SwarmError
from swarm.local_swarm import Proc, SwarmProcesses
from tests.test_failover import ActAfterTokens
from tests.test_swarm_generate import prompt

pytestmark = pytest.mark.slow
TIMEOUT_S = 30.0


def start_servers(swarm: SwarmProcesses, model: Path, *servers: str | tuple[str, ...]) -> list[Proc]:
    """Starts the DHT and a server per entry (its blocks, or its blocks and extra arguments); returns once all serve."""
    swarm.start_dht()
    started = [swarm.start_server(model, *((entry,) if isinstance(entry, str) else entry), wait=False)
               for entry in servers]
    for server in started:
        swarm.wait_ready(server)
    return started


def infos(client: SwarmClient) -> dict[str, dict[str, Any]]:
    """Gives every server's `info` reply, by peer id."""
    replies = {}
    for peer_id, record in client.run(client.servers()).items():
        connection = client.run(client.connect(record))
        try:
            replies[peer_id] = client.run(connection.call("info", {}, timeout=TIMEOUT_S))
        finally:
            client.run(connection.close())
    return replies


def other_host(client: SwarmClient, peer_id: str) -> str:
    """Gives the other server that hosts the same blocks as `peer_id`."""
    records = client.run(client.servers())
    blocks = (records[peer_id].block_start, records[peer_id].block_end)
    (other,) = [p for p, r in records.items() if p != peer_id and (r.block_start, r.block_end) == blocks]
    return other


@pytest.mark.parametrize(("mode", "push"), [("kv", True), ("kv", False), ("replay", True)],
                         ids=["kv-push", "kv-no-push", "replay-push"])
def test_sessions_move_mid_generation_and_tokens_match(
    swarm_factory: SwarmProcesses, tiny_llama: Path, mode: str, push: bool
) -> None:
    start_servers(swarm_factory, tiny_llama, "0:4", "0:4", "4:8", "4:8")
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    remote = DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama), initial_peers=swarm_factory.initial_peers,
        client_config=ClientConfig(request_timeout_s=TIMEOUT_S, server_push=push),
    )
    try:
        client = remote.swarm
        baseline = {peer: info["record"]["pages_free"] for peer, info in infos(client).items()}
        input_ids = prompt(30, 7)
        expected = local.generate(input_ids, max_new_tokens=16, do_sample=False)
        moved: list[tuple[str, str]] = []
        with remote.inference_session(max_length=64) as session:

            def move(span_index: int) -> Callable[[], None]:
                def act() -> None:
                    source = session.route[span_index].peer_id
                    destination = other_host(client, source)
                    session.migrate(span_index, destination, mode=mode)
                    moved.append((source, destination))
                    assert session.route[span_index].peer_id == destination

                return act

            streamer = ActAfterTokens({3: move(1), 9: move(0)})
            actual = remote.generate(input_ids, session=session, max_new_tokens=16, do_sample=False, streamer=streamer)
            assert (session.moves, session.failovers) == (2, 0)  # moved, never failed over
        assert actual.tolist() == expected.tolist()
        replies = infos(client)
        counts = {"kv": 1, "replay": 0} if mode == "kv" else {"kv": 0, "replay": 1}
        for source, destination in moved:
            assert replies[source]["migrations"]["out"] == counts
            assert replies[destination]["migrations"]["in"] == counts
            sent, received = replies[source]["migrations"]["bytes_out"], replies[destination]["migrations"]["bytes_in"]
            assert sent == received and (sent > 0) == (mode == "kv")
        assert {peer: info["record"]["pages_free"] for peer, info in replies.items()} == baseline
    finally:
        remote.shutdown()


def test_only_the_sessions_client_may_move_it_and_a_moved_session_is_gone_from_its_source(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    start_servers(swarm_factory, tiny_llama, "0:8", "0:8")
    config = ClientConfig(request_timeout_s=TIMEOUT_S)
    owner = DistributedModelForCausalLM.from_pretrained(str(tiny_llama), initial_peers=swarm_factory.initial_peers,
                                                       client_config=config)
    stranger = DistributedModelForCausalLM.from_pretrained(str(tiny_llama), initial_peers=swarm_factory.initial_peers,
                                                          client_config=config)
    try:
        with owner.inference_session(max_length=32) as session:
            owner.generate(prompt(12, 3), session=session, max_new_tokens=2, do_sample=False)
            (span,) = session.route
            destination = other_host(owner.swarm, span.peer_id)
            record = stranger.swarm.run(stranger.swarm.servers())[span.peer_id]
            connection = stranger.swarm.run(stranger.swarm.connect(record))
            try:
                session_id = session.remote.spans[0].session_id
                with pytest.raises(MigrationRefused):  # a peer that is not the session's client cannot move it
                    stranger.swarm.run(connection.call(
                        "migrate", {"session_id": session_id, "peer_id": destination}, timeout=TIMEOUT_S))
                with pytest.raises(SessionNotFound):  # nor write KV into a session it does not import
                    stranger.swarm.run(connection.call(
                        "import_kv", {"session_id": session_id, "block": 0, "row": 0, "start": 0}, timeout=TIMEOUT_S))
                session.migrate(0, destination)
                with pytest.raises(SessionNotFound):  # the source holds nothing of it any more
                    stranger.swarm.run(connection.call("close", {"session_id": session_id}, timeout=TIMEOUT_S))
            finally:
                stranger.swarm.run(connection.close())
            assert session.route[0].peer_id == destination
    finally:
        owner.shutdown()
        stranger.shutdown()


def test_a_draining_server_moves_its_sessions_to_a_peer_and_they_go_on_without_a_replay(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    servers = start_servers(swarm_factory, tiny_llama, "0:8", "0:8")
    by_peer = {server.peer_id: server for server in servers}
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    remote = DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama), initial_peers=swarm_factory.initial_peers,
        client_config=ClientConfig(request_timeout_s=TIMEOUT_S),
    )
    try:
        input_ids = prompt(20, 5)
        expected = local.generate(input_ids, max_new_tokens=12, do_sample=False)
        drained: list[str] = []
        with remote.inference_session(max_length=48) as session:

            def drain() -> None:  # SIGTERM to the server process only: its p2p daemon must carry the KV out
                peer_id = session.route[0].peer_id
                drained.append(peer_id)
                by_peer[peer_id].popen.send_signal(signal.SIGTERM)
                # the generation waits here until the session has moved (else it could end before the move)
                (survivor,) = set(by_peer) - {peer_id}
                deadline = time.monotonic() + 60
                while infos(remote.swarm).get(survivor, {}).get("migrations", {}).get("in", {}).get("kv") != 1:
                    assert time.monotonic() < deadline, "the draining server moved no session"
                    time.sleep(0.2)

            streamer = ActAfterTokens({4: drain})
            actual = remote.generate(input_ids, session=session, max_new_tokens=12, do_sample=False, streamer=streamer)
            assert (session.moves, session.failovers) == (1, 0)
            assert session.route[0].peer_id != drained[0]
        assert actual.tolist() == expected.tolist()
        assert by_peer[drained[0]].popen.wait(timeout=60) == 0
        (survivor,) = infos(remote.swarm).values()
        assert survivor["migrations"]["in"] == {"kv": 1, "replay": 0}
        assert survivor["record"]["pages_kv"] == 0  # the moved session closed with the generation
    finally:
        remote.shutdown()


def test_a_move_the_destination_refuses_leaves_the_session_whole_on_its_source(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    # the second server cannot hold the session's 40 tokens
    source, cramped = start_servers(swarm_factory, tiny_llama, "0:8", ("0:8", "--max-length", "16"))
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    remote = DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama), initial_peers=swarm_factory.initial_peers,
        client_config=ClientConfig(request_timeout_s=TIMEOUT_S),
    )
    try:
        client = remote.swarm
        baseline = {peer: info["record"]["pages_free"] for peer, info in infos(client).items()}
        input_ids = prompt(20, 9)
        expected = local.generate(input_ids, max_new_tokens=10, do_sample=False)
        refusals: list[SwarmError] = []
        with remote.inference_session(max_length=40) as session:
            assert session.route[0].peer_id == source.peer_id  # the other one cannot hold 40 tokens

            def try_move() -> None:
                try:
                    session.migrate(0, cramped.peer_id)
                except SwarmError as error:
                    refusals.append(error)

            actual = remote.generate(input_ids, session=session, max_new_tokens=10, do_sample=False,
                                     streamer=ActAfterTokens({3: try_move}))
            assert (session.moves, session.failovers) == (0, 0) and session.route[0].peer_id == source.peer_id
        assert [type(error) for error in refusals] == [MaxLengthExceeded]
        assert actual.tolist() == expected.tolist()
        replies = infos(client)
        assert replies[source.peer_id]["migrations"]["failed_out"] == 1
        assert {peer: info["record"]["pages_free"] for peer, info in replies.items()} == baseline
    finally:
        remote.shutdown()
