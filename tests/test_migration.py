"""Live KV migration: a session's KV moves to a peer hosting the same blocks mid-generation, the session goes on
there without a replay, greedy tokens stay those of the local model, and both pools return to their baselines."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import ClientConfig, DistributedModelForCausalLM
from client.inference import InferenceSession
from client.swarm_client import SwarmClient
from swarm.errors import MaxLengthExceeded, MigrationRefused, ServerBusy, SessionNotFound, SwarmError
from swarm.local_swarm import REPO, Proc, SwarmProcesses
from tests.test_failover import ActAfterTokens
from tests.test_swarm_generate import prompt

pytestmark = [pytest.mark.slow, pytest.mark.own_swarm]
TIMEOUT_S = 30.0


def local_and_remote(swarm: SwarmProcesses, model: Path, **config: Any) -> tuple[Any, DistributedModelForCausalLM]:
    """Gives the local reference model and a swarm client (ClientConfig `config`, by default a 30 s request
    timeout)."""
    local = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    remote = DistributedModelForCausalLM.from_pretrained(
        str(model), initial_peers=swarm.initial_peers,
        client_config=ClientConfig(**{"request_timeout_s": TIMEOUT_S, **config}),
    )
    return local, remote


def start_servers(swarm: SwarmProcesses, model: Path, *servers: str | tuple[str, ...],
                  launcher: Sequence[str] = ()) -> list[Proc]:
    """Starts the DHT and a server per entry (its blocks, or its blocks and extra arguments), each under `launcher`;
    returns once all serve."""
    swarm.start_dht()
    started = [swarm.start_server(model, *((entry,) if isinstance(entry, str) else entry), wait=False,
                                  launcher=launcher) for entry in servers]
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


def info_of(client: SwarmClient, peer_id: str) -> dict[str, Any]:
    """Gives one server's `info` reply."""
    with watching(client, peer_id) as info:
        return info()


@contextlib.contextmanager
def watching(client: SwarmClient, peer_id: str) -> Iterator[Callable[[], dict[str, Any]]]:
    """Gives a function that asks one server for its `info` on one open stream (a few ms a call, where a lookup in
    the DHT first would take far longer: fast enough to catch a move in the middle)."""
    record = client.run(client.servers())[peer_id]
    connection = client.run(client.connect(record))
    try:
        yield lambda: client.run(connection.call("info", {}, timeout=TIMEOUT_S))
    finally:
        client.run(connection.close())


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def in_background(action: Callable[[], object], errors: list[BaseException]) -> threading.Thread:
    """Runs `action` on a thread of its own, keeping what it raised in `errors`."""

    def run() -> None:
        try:
            action()
        except BaseException as error:  # the test asserts on it
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def generate_with_a_refused_move(
    remote: DistributedModelForCausalLM, local: Any, input_ids: torch.Tensor, max_length: int, source: str,
    destination: str,
) -> list[SwarmError]:
    """Generates 10 greedy tokens on a session opened on `source`, trying a KV move of it to `destination` after
    the third; checks that it stayed whole on `source` with the local model's tokens; gives the move's errors."""
    expected = local.generate(input_ids, max_new_tokens=10, do_sample=False)
    refusals: list[SwarmError] = []
    with remote.inference_session(max_length=max_length) as session:
        assert session.route[0].peer_id == source

        def try_move() -> None:
            try:
                session.migrate(0, destination, mode="kv")
            except SwarmError as error:
                refusals.append(error)

        actual = remote.generate(input_ids, session=session, max_new_tokens=10, do_sample=False,
                                 streamer=ActAfterTokens({3: try_move}))
        assert (session.moves, session.failovers) == (0, 0) and session.route[0].peer_id == source
    assert actual.tolist() == expected.tolist()
    return refusals


SLOW_MOVES = ("--migration-chunk-size", "256B")  # a frame per token, block and row: a move takes hundreds of frames


def gated(gate: Path) -> list[str]:
    """Gives the launcher of a server whose imports, past their first frame, wait while the file `gate` exists (see
    tests/gated_imports): the test holds a move in its middle, with no race against the move's end."""
    return ["env", f"PYTHONPATH={Path(__file__).parent / 'gated_imports'}:{REPO}",
            f"CHAINSWARM_TEST_IMPORT_GATE={gate}"]


def other_host(client: SwarmClient, peer_id: str) -> str:
    """Gives the other server that hosts the same blocks as `peer_id`."""
    records = client.run(client.servers())
    blocks = (records[peer_id].block_start, records[peer_id].block_end)
    (other,) = [p for p, r in records.items() if p != peer_id and (r.block_start, r.block_end) == blocks]
    return other


MOVE_VARIANTS = [("kv", True), ("kv", False), ("replay", True), ("auto", True)]  # (mode, the servers push)


def move_span(client: SwarmClient, session: InferenceSession, span_index: int, mode: str,
              moved: list[tuple[str, str, str]]) -> Callable[[], None]:
    """Gives an action that moves the session's span `span_index` to the other server of its blocks by `mode` and
    notes (source, destination, the mode taken) in `moved`."""
    def act() -> None:
        source = session.route[span_index].peer_id
        destination = other_host(client, source)
        reply = session.migrate(span_index, destination, mode=mode)
        assert reply["mode"] == mode or (mode == "auto" and set(reply["expected_s"]) == {"kv", "replay"})
        moved.append((source, destination, reply["mode"]))
        assert session.route[span_index].peer_id == destination

    return act


def test_sessions_move_mid_generation_and_tokens_match(swarm_factory: SwarmProcesses, tiny_llama: Path) -> None:
    """Each move mode, with and without the servers' push, on one swarm: a session moves its second span after token
    3 and its first span there and back after tokens 9 and 12, with the local model's greedy tokens, no failover, the
    moves counted where they went (as deltas: the variants run one after the other) and every page back."""
    start_servers(swarm_factory, tiny_llama, "0:4", "0:4", "4:8", "4:8")
    local, pushing = local_and_remote(swarm_factory, tiny_llama, server_push=True)
    _, relaying = local_and_remote(swarm_factory, tiny_llama, server_push=False)
    try:
        client = pushing.swarm
        baseline = {peer: info["record"]["pages_free"] for peer, info in infos(client).items()}
        input_ids = prompt(30, 7)
        expected = local.generate(input_ids, max_new_tokens=16, do_sample=False)
        for mode, push in MOVE_VARIANTS:
            variant = f"{mode}, {'push' if push else 'no push'}"
            remote = pushing if push else relaying
            before = {peer: info["migrations"] for peer, info in infos(client).items()}
            moved: list[tuple[str, str, str]] = []
            with remote.inference_session(max_length=64) as session:
                # the first span moves there and back: its client may move it again where it arrived
                streamer = ActAfterTokens({token: move_span(client, session, span, mode, moved)
                                           for token, span in ((3, 1), (9, 0), (12, 0))})
                actual = remote.generate(input_ids, session=session, max_new_tokens=16, do_sample=False,
                                         streamer=streamer)
                assert (session.moves, session.failovers) == (3, 0), variant  # moved, never failed over
            assert actual.tolist() == expected.tolist(), variant
            after = {peer: info["migrations"] for peer, info in infos(client).items()}
            grown: dict[str, dict[str, dict[str, int]]] = {
                peer: {way: {kind: after[peer][way][kind] - before[peer][way][kind] for kind in ("kv", "replay")}
                       for way in ("out", "in", "chosen")} for peer in after}
            expected_counts: dict[str, dict[str, dict[str, int]]] = {
                peer: {way: {"kv": 0, "replay": 0} for way in ("out", "in", "chosen")} for peer in after}
            for source, destination, taken in moved:
                for peer, way in ((source, "out"), (destination, "in")):
                    expected_counts[peer][way][taken] += 1
                if mode == "auto":
                    expected_counts[source]["chosen"][taken] += 1
                sent = after[source]["bytes_out"] - before[source]["bytes_out"]
                received = after[destination]["bytes_in"] - before[destination]["bytes_in"]
                assert sent == received and (sent > 0) == (taken == "kv"), variant
            assert grown == expected_counts, variant
            assert {peer: info["record"]["pages_free"] for peer, info in infos(client).items()} == baseline, variant
    finally:
        pushing.shutdown()
        relaying.shutdown()


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
                        "import_kv", {"session_id": session_id, "pieces": [{"block": 0, "row": 0, "start": 0}]},
                        timeout=TIMEOUT_S))
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
    local, remote = local_and_remote(swarm_factory, tiny_llama)
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


def test_a_session_its_client_closes_before_it_learned_where_a_draining_server_moved_it_closes_there_too(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    servers = start_servers(swarm_factory, tiny_llama, "0:8", "0:8")
    by_peer = {server.peer_id: server for server in servers}
    _, remote = local_and_remote(swarm_factory, tiny_llama)
    try:
        with remote.inference_session(max_length=48) as session:
            remote.generate(prompt(20, 6), session=session, max_new_tokens=3, do_sample=False)
            drained = session.route[0].peer_id
            (survivor,) = set(by_peer) - {drained}
            with watching(remote.swarm, survivor) as info:
                by_peer[drained].popen.send_signal(signal.SIGTERM)  # it moves the session, whole, to the survivor
                deadline = time.monotonic() + 60
                while info()["migrations"]["in"]["kv"] != 1:
                    assert time.monotonic() < deadline, "the draining server moved no session"
                    time.sleep(0.2)
                assert info()["record"]["pages_kv"] > 0
        # the client closed it on the server it knew, with no step since the move: that server closes it where it
        # went (before r72 it stayed open there, its pages held, until the session timeout: 300 s)
        with watching(remote.swarm, survivor) as info:
            deadline = time.monotonic() + 15
            while info()["record"]["pages_kv"] != 0:
                assert time.monotonic() < deadline, "the moved session stayed open on the survivor"
                time.sleep(0.2)
        assert by_peer[drained].popen.wait(timeout=60) == 0  # no session left unclaimed: the drain ends
    finally:
        remote.shutdown()


def test_a_move_the_destination_refuses_leaves_the_session_whole_on_its_source(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    # the second server cannot hold the session's 40 tokens
    source, cramped = start_servers(swarm_factory, tiny_llama, "0:8", ("0:8", "--max-length", "16"))
    local, remote = local_and_remote(swarm_factory, tiny_llama)
    try:
        client = remote.swarm
        baseline = {peer: info["record"]["pages_free"] for peer, info in infos(client).items()}
        input_ids = prompt(20, 9)
        # the other one cannot hold 40 tokens
        refusals = generate_with_a_refused_move(remote, local, input_ids, 40, source.peer_id, cramped.peer_id)
        assert [type(error) for error in refusals] == [MaxLengthExceeded]
        replies = infos(client)
        assert replies[source.peer_id]["migrations"]["failed_out"] == 1
        assert {peer: info["record"]["pages_free"] for peer, info in replies.items()} == baseline
    finally:
        remote.shutdown()


@pytest.mark.parametrize("victim", ["destination", "source"])
def test_a_server_that_dies_mid_transfer_loses_no_token_and_no_page(
    swarm_factory: SwarmProcesses, tiny_llama: Path, victim: str, tmp_path: Path
) -> None:
    """The destination dies: the session stays whole on its source. The source dies: the client fails over (a replay
    on the survivor), and the survivor drops the half-done import once it hears nothing more."""
    extra = (*SLOW_MOVES, "--import-idle-timeout", "1", "--session-timeout", "4")
    gate = tmp_path / "gate"
    gate.touch()  # the destination takes the move's first frame, then holds the next until the kill
    servers = start_servers(swarm_factory, tiny_llama, ("0:8", *extra), ("0:8", *extra), launcher=gated(gate))
    by_peer = {server.peer_id: server for server in servers}
    local, remote = local_and_remote(swarm_factory, tiny_llama)
    try:
        client = remote.swarm
        baseline = {peer: info["record"]["pages_free"] for peer, info in infos(client).items()}
        input_ids = prompt(40, 11)  # 344 frames of KV to move
        expected = local.generate(input_ids, max_new_tokens=10, do_sample=False)
        errors: list[BaseException] = []
        ends: dict[str, str] = {}
        with remote.inference_session(max_length=64) as session:

            def kill_mid_move() -> None:
                ends["source"] = session.route[0].peer_id
                ends["destination"] = other_host(client, ends["source"])
                with watching(client, ends["destination"]) as info:
                    mover = in_background(lambda: session.migrate(0, ends["destination"], mode="kv"), errors)
                    wait_until(lambda: info()["migrations"]["bytes_in"] > 0, "the first chunk")
                swarm_factory.kill(by_peer[ends[victim]])
                gate.unlink()  # the survivor's held frame goes on: to an import the source can no longer commit
                mover.join(TIMEOUT_S * 2)
                assert not mover.is_alive()

            actual = remote.generate(input_ids, session=session, max_new_tokens=10, do_sample=False,
                                     streamer=ActAfterTokens({3: kill_mid_move}))
            (survivor,) = set(ends.values()) - {ends[victim]}
            # on its source with its KV, or replayed on the survivor since its source is gone
            assert (session.moves, session.failovers) == (0, 0 if victim == "destination" else 1)
            assert session.route[0].peer_id == survivor
        assert [isinstance(error, SwarmError) for error in errors] == [True]
        assert actual.tolist() == expected.tolist()
        # the generation closed the session; a half-done import is dropped once it received nothing for a second
        wait_until(lambda: info_of(client, survivor)["record"]["pages_free"] == baseline[survivor],
                   "the survivor's pages to return", timeout_s=30)
        reply = info_of(client, survivor)
        if victim == "destination":
            assert reply["migrations"]["failed_out"] == 1 and reply["migrations"]["out"] == {"kv": 0, "replay": 0}
        else:
            assert reply["migrations"]["in"] == {"kv": 0, "replay": 0}
    finally:
        remote.shutdown()


def test_a_destination_out_of_pages_refuses_the_move_and_the_session_stays_whole(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    swarm_factory.start_dht()
    # 20 free KV pages of 16 KB (62 tokens of one block each): a session of 100 tokens over the 8 blocks holds 16 of
    # them, and one moving in needs 8 for its first 62 tokens
    full = swarm_factory.start_server(tiny_llama, "0:8", "--memory", "1600KB", "--page-size", "16KB",
                                      "--max-length", "128")
    config = ClientConfig(request_timeout_s=TIMEOUT_S)
    squatter = DistributedModelForCausalLM.from_pretrained(str(tiny_llama), initial_peers=swarm_factory.initial_peers,
                                                          client_config=config)
    remote = None
    try:
        with squatter.inference_session(max_length=124) as held:
            squatter.generate(prompt(20, 13), session=held, max_new_tokens=80, min_new_tokens=80, do_sample=False)
            assert held.route[0].peer_id == full.peer_id
            source = swarm_factory.start_server(tiny_llama, "0:8")
            remote = DistributedModelForCausalLM.from_pretrained(
                str(tiny_llama), initial_peers=swarm_factory.initial_peers, client_config=config)
            client = remote.swarm
            wait_until(lambda: len(client.run(client.servers())) == 2, "both servers in the DHT")
            baseline = {peer: info["record"]["pages_free"] for peer, info in infos(client).items()}
            local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
            input_ids = prompt(30, 14)
            # the full server refused the session at open: it opened on the other one
            refusals = generate_with_a_refused_move(remote, local, input_ids, 60, source.peer_id, full.peer_id)
            assert [type(error) for error in refusals] == [ServerBusy]
            replies = infos(client)
            assert replies[source.peer_id]["migrations"]["failed_out"] == 1
            assert {peer: info["record"]["pages_free"] for peer, info in replies.items()} == baseline
    finally:
        squatter.shutdown()
        if remote is not None:
            remote.shutdown()


@pytest.mark.parametrize("push", [True, False], ids=["push", "no-push"])
def test_steps_that_arrive_during_a_move_wait_and_follow_it_without_a_replay(
    swarm_factory: SwarmProcesses, tiny_llama: Path, push: bool, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.touch()  # the destination takes the move's first frame, then holds the next until a step waits for the move
    servers = start_servers(swarm_factory, tiny_llama, "0:4", ("4:8", *SLOW_MOVES), ("4:8", *SLOW_MOVES),
                            launcher=gated(gate))
    by_peer = {server.peer_id: server for server in servers}
    # The held step waits for the whole move (600 frames, one round trip each): on a loaded machine that can take
    # longer than 30 s, and a timeout would turn the move into a failover.
    local, remote = local_and_remote(swarm_factory, tiny_llama, server_push=push, request_timeout_s=120.0)
    try:
        client = remote.swarm
        baseline = {peer: info["record"]["pages_free"] for peer, info in infos(client).items()}
        input_ids = prompt(150, 15)  # 600 frames of KV to move
        expected = local.generate(input_ids, max_new_tokens=12, do_sample=False)
        errors: list[BaseException] = []
        threads: list[threading.Thread] = []
        ends: list[tuple[str, str]] = []
        with remote.inference_session(max_length=192) as session:

            def move_while_generating() -> None:
                source = session.route[1].peer_id
                destination = by_peer[other_host(client, source)]
                ends.append((source, destination.peer_id))
                with watching(client, destination.peer_id) as info:
                    threads.append(in_background(lambda: session.migrate(1, destination.peer_id, mode="kv"), errors))
                    wait_until(lambda: info()["migrations"]["bytes_in"] > 0, "a chunk")

                # The destination holds the rest of the move until the generation's next step has reached the
                # source; then the move goes on, and that step learns where the session went once it committed.
                def resume_once_a_step_waits() -> None:
                    try:
                        with watching(client, source) as info:
                            wait_until(lambda: info()["migrations"]["held_steps"] >= 1, "a held step")
                    finally:
                        gate.unlink()

                threads.append(in_background(resume_once_a_step_waits, errors))

            actual = remote.generate(input_ids, session=session, max_new_tokens=12, do_sample=False,
                                     streamer=ActAfterTokens({3: move_while_generating}))
            for thread in threads:
                thread.join(TIMEOUT_S * 2)
            assert (session.moves, session.failovers) == (1, 0)
            assert session.route[1].peer_id == ends[0][1]
        assert errors == []
        assert actual.tolist() == expected.tolist()
        replies = infos(client)
        source, destination_id = ends[0]
        assert replies[source]["migrations"]["held_steps"] >= 1
        assert replies[source]["migrations"]["out"] == {"kv": 1, "replay": 0}
        assert replies[destination_id]["migrations"]["in"] == {"kv": 1, "replay": 0}
        assert {peer: info["record"]["pages_free"] for peer, info in replies.items()} == baseline
    finally:
        remote.shutdown()


def test_servers_of_one_segment_pack_their_sessions_and_the_emptied_one_stands_by(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    packing = ("--kv-packing", "bf", "--packing-epoch", "0.5")
    servers = start_servers(swarm_factory, tiny_llama, ("0:8", *packing), ("0:8", *packing), ("0:8", *packing))
    local, remote = local_and_remote(swarm_factory, tiny_llama)
    try:
        client = remote.swarm
        wait_until(lambda: len(client.run(client.servers())) == 3, "three servers in the DHT")
        baseline = {peer: info["record"]["pages_free"] for peer, info in infos(client).items()}
        prompts = [prompt(20, 21), prompt(24, 22)]
        turns = [prompt(3, 23), prompt(4, 24)]
        with remote.inference_session(max_length=64) as first, remote.inference_session(max_length=64) as second:
            sessions = [first, second]
            outputs = [remote.generate(p, session=s, max_new_tokens=4, do_sample=False)
                       for p, s in zip(prompts, sessions, strict=True)]
            leader = min(server.peer_id for server in servers)
            if first.route[0].peer_id == second.route[0].peer_id:  # spread them, for the packing to undo
                with contextlib.suppress(SwarmError):  # unless the packing moved one of them first
                    second.migrate(0, other_hosts(client, first.route[0].peer_id)[0], mode="kv")
            seen: list[tuple[int, int, int]] = []

            def settled() -> bool:  # a session moved by replay is on no server until its client's next step
                replies = infos(client)
                moves = replies[leader]["packing"]["moves"]
                standbys = [peer for peer, info in replies.items() if not info["record"]["accepting"]]
                seen.append((moves["kv"] + moves["replay"], len(standbys), replies[leader]["packing"]["epochs"]))
                # at least one move, one standby, and two more epochs without a move (members learn whether to
                # take sessions one epoch after the leader decided)
                done = [state for state in seen if state[0] == seen[-1][0] and state[1] == 1]
                return seen[-1][0] >= 1 and len(done) >= 2 and seen[-1][2] - done[0][2] >= 2

            wait_until(settled, "the packing to settle", timeout_s=60)
            replies = infos(client)
            standby = [peer for peer, info in replies.items() if not info["record"]["accepting"]]
            assert len(standby) == 1 and replies[standby[0]]["record"]["session_count"] == 0
            # the sessions go on where they were packed, with the tokens of the local model
            for index, session in enumerate(sessions):
                continued = remote.generate(turns[index], session=session, max_new_tokens=4, do_sample=False)
                history = torch.cat([outputs[index], turns[index]], dim=1)
                expected = local.generate(history, max_new_tokens=4, do_sample=False)
                assert continued.tolist() == expected[:, outputs[index].shape[1]:].tolist()
                assert session.failovers == 0
            # best fit keeps them on one server, and one spare open
            assert first.route[0].peer_id == second.route[0].peer_id != standby[0]
            assert sum(s.moves for s in sessions) >= 1
        replies = infos(client)
        assert {peer: info["record"]["pages_free"] for peer, info in replies.items()} == baseline
    finally:
        remote.shutdown()


def other_hosts(client: SwarmClient, peer_id: str) -> list[str]:
    """Gives the other servers that host the same blocks as `peer_id`, in peer id order."""
    records = client.run(client.servers())
    blocks = (records[peer_id].block_start, records[peer_id].block_end)
    return sorted(p for p, r in records.items() if p != peer_id and (r.block_start, r.block_end) == blocks)
