"""KunServe's drop and restore on live servers: two replicas of a segment drop half of it each on their
orchestrator's word, a running session goes on through both (replayed from its client's saved inputs) with the local
model's tokens, the dropped blocks' pages hold KV, and a restore brings every block and page back."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P

from client import ClientConfig, DistributedModelForCausalLM
from client.inference import RemoteInferenceSession
from client.swarm_client import SwarmClient
from orchestrator.buddy import SegmentReplica, groups_of, plan_merge
from swarm.errors import AssignmentRefused, MigrationRefused
from swarm.local_swarm import Proc, SwarmProcesses
from swarm.signing import load_identity, peer_id_of
from tests.test_failover import ActAfterTokens
from tests.test_migration import info_of, infos, local_and_remote
from tests.test_swarm_generate import prompt

pytestmark = [pytest.mark.slow, pytest.mark.own_swarm]
TIMEOUT_S = 30.0
LATE_COLLECT_S = 1.0  # how late the client asks for a pushed step's outputs after the restore


def call(client: SwarmClient, peer_id: str, method: str, payload: dict[str, Any]) -> dict[str, Any]:
    record = client.run(client.servers())[peer_id]
    connection = client.run(client.connect(record))
    try:
        return client.run(connection.call(method, payload, timeout=TIMEOUT_S))
    finally:
        client.run(connection.close())


def wait_for_ranges(client: SwarmClient, ranges: dict[str, tuple[int, int]]) -> None:
    """Waits until the DHT shows each server with its range (the records are re-announced at once)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        records = client.run(client.servers())
        if all(peer in records and (records[peer].block_start, records[peer].block_end) == blocks
               for peer, blocks in ranges.items()):
            return
        time.sleep(0.2)
    raise AssertionError(f"the DHT did not show the ranges {ranges}")


def count_lookups(client: SwarmClient) -> list[float]:
    """Has `client` note the time of each DHT lookup of its servers in the list it gives."""
    lookups: list[float] = []
    looked_up = client.servers

    async def servers() -> dict[str, Any]:
        lookups.append(time.monotonic())
        return await looked_up()

    client.servers = servers  # type: ignore[method-assign]
    return lookups


def wait_until_reshaped(client: SwarmClient, peers: list[str]) -> dict[str, dict[str, Any]]:
    """Waits until no exchange or merge runs on `peers`; gives their `info`."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = {peer: info for peer, info in infos(client).items() if peer in peers}
        if len(found) == len(peers) and not any(info["dropping"]["reshaping"] for info in found.values()):
            return found
        time.sleep(0.1)
    raise AssertionError(f"servers {peers} kept reshaping")


def start_replicas(swarm_factory: SwarmProcesses, model: Path, client: SwarmClient,
                   *flags: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Starts two servers of blocks 0:8 that follow `client` as their orchestrator (it may make them drop); gives
    their peer ids and their records once the DHT shows both."""
    orchestrator = client.p2p.peer_id.to_base58()
    servers = [swarm_factory.start_server(model, "0:8", "--orchestrator", orchestrator, *flags, wait=False)
               for _ in range(2)]
    for server in servers:
        swarm_factory.wait_ready(server)
    peers = [server.peer_id for server in servers]
    wait_for_ranges(client, {peer: (0, 8) for peer in peers})
    return peers, {peer: info["record"] for peer, info in infos(client).items()}


def test_replicas_drop_half_each_a_running_session_moves_its_kv_through_both_and_merges_back_after_a_restore(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    swarm_factory.start_dht()
    local, remote = local_and_remote(swarm_factory, tiny_llama)
    client = remote.swarm
    try:
        # blocking: on this tiny model a replay is cheaper, and `auto` would pick it
        peers, baseline = start_replicas(swarm_factory, tiny_llama, client, "--kv-exchange", "blocking")
        input_ids = prompt(5, 24)
        expected = local.generate(input_ids, max_new_tokens=12, do_sample=False)
        halves: dict[str, tuple[int, int]] = {}
        lookups = count_lookups(client)

        with remote.inference_session(max_length=64) as session:

            def drop_halves() -> None:
                first = session.route[0].peer_id  # the session runs here; it keeps the first half
                (second,) = set(peers) - {first}
                halves.update({first: (0, 4), second: (4, 8)})
                replies = {peer: call(client, peer, "drop", {"blocks": list(blocks)})
                           for peer, blocks in halves.items()}
                assert replies[first] == {"blocks": [0, 4], "victims": 1, "restorable": [0, 8]}
                assert replies[second] == {"blocks": [4, 8], "victims": 0, "restorable": [0, 8]}
                wait_for_ranges(client, halves)
                # the victim's KV of blocks 4:8 went to the second server while the client waited here
                assert wait_until_reshaped(client, peers)[first]["dropping"]["exchange"]["moved"] == 1
                lookups.clear()

            actual = remote.generate(input_ids, session=session, max_new_tokens=12, do_sample=False,
                                     streamer=ActAfterTokens({4: drop_halves}))
            assert (session.failovers, session.moves) == (0, 1)  # no replay: the chain changed with the KV
            # it followed the new chain on the records it had: the hops name the servers, a lookup adds nothing
            assert [follow.followed for follow in session.chain_follows] == [True]
            assert lookups == []
            assert [(span.peer_id, span.start, span.end) for span in session.route] == [
                (peer, *halves[peer]) for peer in sorted(halves, key=lambda peer: halves[peer])]
        assert actual.tolist() == expected.tolist()

        dropped = wait_until_reshaped(client, peers)
        for peer, blocks in halves.items():
            record = dropped[peer]["record"]
            assert (record["block_start"], record["block_end"]) == blocks
            assert (record["restorable_start"], record["restorable_end"]) == (0, 8)
            assert record["pages_params"] == baseline[peer]["pages_params"] // 2  # four of eight blocks, alike
            assert record["pages_free"] == baseline[peer]["pages_free"] + baseline[peer]["pages_params"] // 2
            assert dropped[peer]["dropping"]["drops"] == 1
            assert dropped[peer]["dropping"]["restorable"] == [0, 8]
        first = min(halves, key=lambda peer: halves[peer])
        assert dropped[first]["dropping"]["exchange"]["replayed"] == 0
        assert dropped[first]["migrations"]["out"]["kv"] == 1

        # a new session routes through the two halves as one chain; the servers restore under it
        with remote.inference_session(max_length=64) as session:

            def restore_both() -> None:
                assert len(session.route) == 2
                for peer in halves:
                    assert call(client, peer, "restore", {}) == {"blocks": [0, 8], "evicted": 0, "restored": True}
                wait_for_ranges(client, {peer: (0, 8) for peer in halves})
                merged = wait_until_reshaped(client, peers)
                assert sum(info["dropping"]["exchange"]["merged"] for info in merged.values()) == 1

            again = remote.generate(input_ids, session=session, max_new_tokens=10, do_sample=False,
                                    streamer=ActAfterTokens({3: restore_both}))
            assert session.failovers == 0
            assert [(span.start, span.end) for span in session.route] == [(0, 8)]  # merged back into one server
        assert again.tolist() == local.generate(input_ids, max_new_tokens=10, do_sample=False).tolist()

        for peer, info in wait_until_reshaped(client, peers).items():
            assert info["record"]["pages_free"] == baseline[peer]["pages_free"]
            assert info["record"]["restorable_start"] is None
            assert (info["dropping"]["drops"], info["dropping"]["restores"]) == (1, 1)
            assert info["dropping"]["restorable"] is None
    finally:
        remote.shutdown()


def test_live_exchange_victims_go_on_at_once_through_the_keeper_which_attends_over_the_lent_kv_until_it_followed(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    """`--kv-exchange live` (KunServe's remote attention): right after the drop, the victim's next step runs on the
    keeper, which sends each block's queries, keys and values to the victim's server while that block's KV is still
    there, copies the KV meanwhile (small chunks: several rounds) and takes the last tokens with a step's attention;
    the tokens equal the local model's, and the lent pages return to the victim's pool."""
    swarm_factory.start_dht()
    local, remote = local_and_remote(swarm_factory, tiny_llama)
    client = remote.swarm
    try:
        peers, baseline = start_replicas(swarm_factory, tiny_llama, client, "--kv-exchange", "live",
                                         "--migration-chunk-size", "1KiB")
        input_ids = prompt(6, 150)  # past TAIL_TOKENS (64): the keeper copies before a step takes the rest
        # 36 tokens after the drop: the copy (22 chunks a block) must reach each block's tail before the session
        # closes, or closing gives the block up unswitched (12 tokens raced it under load)
        expected = local.generate(input_ids, max_new_tokens=40, do_sample=False)
        halves: dict[str, tuple[int, int]] = {}

        with remote.inference_session(max_length=200) as session:

            def drop_halves() -> None:
                first = session.route[0].peer_id
                (second,) = set(peers) - {first}
                halves.update({first: (0, 4), second: (4, 8)})
                for peer, blocks in halves.items():
                    call(client, peer, "drop", {"blocks": list(blocks)})
                wait_for_ranges(client, halves)
                lender = wait_until_reshaped(client, peers)[first]["dropping"]
                assert (lender["exchange"]["moved"], lender["live"]["lent_sessions"]) == (1, 1)
                assert lender["live"]["lent_blocks_open"] == 4  # nothing copied before the next steps

            actual = remote.generate(input_ids, session=session, max_new_tokens=40, do_sample=False,
                                     streamer=ActAfterTokens({4: drop_halves}))
            assert (session.failovers, session.moves) == (0, 1)
        assert actual.tolist() == expected.tolist()

        first, second = sorted(halves, key=lambda peer: halves[peer])
        deadline = time.monotonic() + TIMEOUT_S
        while (found := infos(client))[first]["dropping"]["live"]["lent_blocks_open"] and time.monotonic() < deadline:
            time.sleep(0.1)
        lender, keeper = found[first], found[second]
        assert lender["dropping"]["live"]["lent_blocks_open"] == 0
        assert keeper["dropping"]["live"]["kept_sessions"] == 1
        # every block switched by one step's attention, after copies of 1 KiB (four tokens each: many per block)
        assert keeper["dropping"]["live"]["switched_blocks"] == 4
        assert lender["dropping"]["live"]["attends_served"] == keeper["dropping"]["live"]["attends_sent"] >= 4
        assert keeper["dropping"]["live"]["copied_bytes"] > 4 * 4096
        assert keeper["steps_computed"]["remote"] >= 1
        assert lender["migrations"]["out"]["kv"] == 0  # no blocking move
        assert lender["record"]["pages_free"] == baseline[first]["pages_free"] + baseline[first]["pages_params"] // 2
    finally:
        remote.shutdown()


def test_live_exchange_moves_a_victim_without_kv_yet_instead_of_lending_it(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    """Under `--kv-exchange live`, a session opened just before the drop, whose prompt has not come yet, has no KV to
    lend: it moves to the keeper at once (no bytes), and its prompt then computes there like any session's instead of
    sending every block's queries, keys and values back to its old server; its tokens equal the local model's."""
    swarm_factory.start_dht()
    local, remote = local_and_remote(swarm_factory, tiny_llama)
    client = remote.swarm
    try:
        peers, _ = start_replicas(swarm_factory, tiny_llama, client, "--kv-exchange", "live")
        input_ids = prompt(7, 40)
        expected = local.generate(input_ids, max_new_tokens=6, do_sample=False)
        with remote.inference_session(max_length=64) as session:
            first = session.route[0].peer_id
            (second,) = set(peers) - {first}
            halves = {first: (0, 4), second: (4, 8)}
            for peer, blocks in halves.items():
                call(client, peer, "drop", {"blocks": list(blocks)})
            wait_for_ranges(client, halves)
            lender = wait_until_reshaped(client, peers)[first]
            assert lender["dropping"]["exchange"]["moved"] == 1
            assert lender["dropping"]["live"]["lent_sessions"] == 0
            assert lender["migrations"]["out"]["kv"] == 1
            actual = remote.generate(input_ids, session=session, max_new_tokens=6, do_sample=False)
            assert session.failovers == 0
            assert [(span.peer_id, span.start, span.end) for span in session.route] == [
                (first, 0, 4), (second, 4, 8)]
        assert actual.tolist() == expected.tolist()
        keeper = infos(client)[second]
        assert keeper["steps_computed"]["remote"] == 0  # no block attended through the old server
    finally:
        remote.shutdown()


def test_a_victims_prompt_computing_at_the_drop_stops_where_its_batch_ends_and_goes_on_through_the_keeper(
    swarm_factory: SwarmProcesses, tiny_llama: Path, tmp_path: Path
) -> None:
    """Blocking exchange: the drop catches a session's 40-token prompt in its first chunks (emulated servers that
    take 4 ms a token and block, 8 tokens a batch: 1.3 s for the prompt). The prompt stops where its batch ends, the
    session moves with no KV, and its client sends the prompt again through both servers, so the dropped blocks go
    without waiting for the rest of the prompt; no replay, and the tokens equal the local model's."""
    profile = tmp_path / "slow-prefill.json"
    profile.write_text(json.dumps({"memory_gb": 16, "prefill_ms_per_token": 4.0, "decode_ms_base": 1.0,
                                   "decode_ms_per_row": 0.0}))
    swarm_factory.start_dht()
    local, remote = local_and_remote(swarm_factory, tiny_llama)
    client = remote.swarm
    try:
        peers, baseline = start_replicas(swarm_factory, tiny_llama, client, "--emulate-gpu", str(profile),
                                         "--max-batch-tokens", "8", "--kv-exchange", "blocking")
        input_ids = prompt(7, 40)
        expected = local.generate(input_ids, max_new_tokens=6, do_sample=False)
        generated: dict[str, torch.Tensor] = {}
        with remote.inference_session(max_length=64) as session:
            first = session.route[0].peer_id
            (second,) = set(peers) - {first}
            thread = threading.Thread(target=lambda: generated.update(ids=remote.generate(
                input_ids, session=session, max_new_tokens=6, do_sample=False)))
            thread.start()
            deadline = time.monotonic() + TIMEOUT_S
            while infos(client)[first]["batches"]["prefill_tokens"] < 8 and time.monotonic() < deadline:
                time.sleep(0.02)  # the prompt's first chunk computed on `first`, four to go
            halves = {first: (0, 4), second: (4, 8)}
            for peer, blocks in halves.items():
                call(client, peer, "drop", {"blocks": list(blocks)})
            thread.join(TIMEOUT_S)
            assert not thread.is_alive()
            assert (session.failovers, session.moves) == (0, 1)
            assert [(span.peer_id, span.start, span.end) for span in session.route] == [
                (first, 0, 4), (second, 4, 8)]
        assert generated["ids"].tolist() == expected.tolist()
        found = wait_until_reshaped(client, peers)
        victim_server = found[first]
        assert victim_server["batches"]["steps_failed"] == {"StepStopped": 1}
        # a chunk or more before the drop, then the whole prompt again over the blocks it kept
        assert 40 + 8 <= victim_server["batches"]["prefill_tokens"] < 40 + 40
        assert found[second]["batches"]["prefill_tokens"] == 40  # its half of the prompt, once
        assert victim_server["dropping"]["exchange"]["moved"] == 1
        assert victim_server["migrations"]["out"]["kv"] == 1
        assert victim_server["record"]["pages_free"] == (baseline[first]["pages_free"]
                                                         + baseline[first]["pages_params"] // 2)
    finally:
        remote.shutdown()


def test_a_session_routed_on_records_from_before_a_drop_takes_the_range_each_server_names_and_opens_at_once(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    """The client's records (a lookup a moment old) still show both replicas whole after each dropped half: a server
    refuses the new session with `BlocksNotHosted` naming the range it serves now, and the client routes on that
    range at once (no fresh lookup, no back-off) and opens across both; the tokens equal the local model's."""
    swarm_factory.start_dht()
    local, remote = local_and_remote(swarm_factory, tiny_llama, records_max_age_s=60.0)
    client = remote.swarm
    try:
        peers, _ = start_replicas(swarm_factory, tiny_llama, client)
        stale = client.run(client.servers())  # the lookup the next session routes on: both whole
        halves = {peers[0]: (0, 4), peers[1]: (4, 8)}
        for peer, blocks in halves.items():  # through the records it has, so that the client looks nothing up
            connection = client.run(client.connect(stale[peer]))
            try:
                client.run(connection.call("drop", {"blocks": list(blocks)}, timeout=TIMEOUT_S))
            finally:
                client.run(connection.close())
        input_ids = prompt(5, 12)
        expected = local.generate(input_ids, max_new_tokens=4, do_sample=False)
        with remote.inference_session(max_length=32) as session:
            outcomes = [(attempt.kind, attempt.outcome) for attempt in session.open_attempts]
            assert ("open", "BlocksNotHosted") in outcomes
            assert not any(outcome == "no route" or kind == "backoff" for kind, outcome in outcomes), outcomes
            assert sorted((span.start, span.end, span.peer_id) for span in session.route) == [
                (0, 4, peers[0]), (4, 8, peers[1])]
            actual = remote.generate(input_ids, session=session, max_new_tokens=4, do_sample=False)
        assert actual.tolist() == expected.tolist()
        record = client.recent_servers(60.0)
        assert record is not None and {peer: (record[peer].block_start, record[peer].block_end)
                                       for peer in peers} == halves  # the next sessions route on them too
    finally:
        remote.shutdown()


def test_only_the_servers_orchestrator_may_make_it_drop_and_only_a_server_of_the_blocks_lend_it_kv(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    swarm_factory.start_dht()
    server = swarm_factory.start_server(tiny_llama, "0:8")
    remote = DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama), initial_peers=swarm_factory.initial_peers,
        client_config=ClientConfig(request_timeout_s=TIMEOUT_S),
    )
    try:
        client = remote.swarm
        wait_for_ranges(client, {server.peer_id: (0, 8)})
        with pytest.raises(AssignmentRefused, match="drop ignored"):
            call(client, server.peer_id, "drop", {"blocks": [0, 4]})
        with pytest.raises(AssignmentRefused, match="restore ignored"):
            call(client, server.peer_id, "restore", {})
        # a lent victim opens whatever the free pages: only a server announcing its blocks may lend one
        lend = {"session_id": "stranger", "blocks": [0, 4], "batch": 1, "max_length": 64, "position": 8}
        with pytest.raises(MigrationRefused, match="attend_open ignored"):
            call(client, server.peer_id, "attend_open", lend)
        (info,) = infos(client).values()
        assert (info["record"]["block_start"], info["record"]["block_end"]) == (0, 8)
        assert info["dropping"]["drops"] == 0
        assert info["dropping"]["live"]["kept_sessions"] == 0
    finally:
        remote.shutdown()


POOL = ("--memory", "1600KB", "--page-size", "16KB")  # tiny Llama: 80 pages of parameters, 20 free for KV
SMALL_SESSIONS = ("--max-length", "64", "--kv-headroom-tokens", "32")  # one KV page per block and session


def ordered_identities(folder: Path, count: int) -> list[Path]:
    """Gives `count` new libp2p identity files (`--identity`) in the order of their peer ids: the first one's server
    would lead any segment the others are in."""
    paths = [folder / f"ordered-{n}.identity" for n in range(count)]
    for path in paths:
        P2P.generate_identity(str(path))
    return sorted(paths, key=lambda path: peer_id_of(load_identity(path).public_key()).to_base58())


def start_dropping_replicas(swarm: SwarmProcesses, model: Path, *, restore_after_s: float,
                            exchange: str = "auto", identities: Sequence[Path] = ()) -> list[Proc]:
    """Starts the DHT and two servers of all blocks with small pools, dropping on their own (`--kv-dropping`);
    `exchange` is how victims go on (on this tiny model `auto` replays them); `identities`: the servers' keys."""
    swarm.start_dht()
    keys = [["--identity", str(path)] for path in identities] or [[], []]
    servers = [swarm.start_server(model, "0:8", *POOL, *SMALL_SESSIONS, "--kv-dropping", "--drop-period", "0.25",
                                  "--restore-after", str(restore_after_s), "--restore-calm", "2",
                                  "--kv-exchange", exchange, *key, wait=False)
               for key in keys]
    for server in servers:
        swarm.wait_ready(server)
    return servers


class Generation:
    """Greedy generations of several prompts at once, a thread each; each calls `after_first_token()`, if given,
    once its first token arrived."""

    def __init__(self, remote: DistributedModelForCausalLM, prompts: list[torch.Tensor], *, new_tokens: int,
                 after_first_token: Callable[[], object] | None = None) -> None:
        self.results: dict[int, list[list[int]]] = {}
        self.errors: list[BaseException] = []
        self.after_first_token = after_first_token
        self.threads = [threading.Thread(target=self._run, args=(remote, index, ids, new_tokens), daemon=True)
                        for index, ids in enumerate(prompts)]
        for thread in self.threads:
            thread.start()

    def _run(self, remote: DistributedModelForCausalLM, index: int, ids: torch.Tensor, new_tokens: int) -> None:
        streamer = ActAfterTokens({1: self.after_first_token}) if self.after_first_token is not None else None
        try:
            self.results[index] = remote.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                                  streamer=streamer).tolist()
        except BaseException as error:  # the test asserts on it
            self.errors.append(error)

    def join(self, timeout_s: float = 180.0) -> None:
        for thread in self.threads:
            thread.join(timeout_s)

    @property
    def outputs(self) -> list[list[list[int]]]:
        return [self.results.get(index, []) for index in range(len(self.threads))]


def generate_watching(remote: DistributedModelForCausalLM, prompts: list[torch.Tensor], *, new_tokens: int,
                      look: Callable[[], None], after_first_token: Callable[[], object] | None = None) -> Generation:
    """Runs the greedy generations of `prompts` at once, calling `look()` every 0.1 s until they all ended (and each
    `after_first_token()` once its first token arrived)."""
    running = threading.Event()
    running.set()

    def watch() -> None:
        while running.is_set():
            look()
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    generation = Generation(remote, prompts, new_tokens=new_tokens, after_first_token=after_first_token)
    generation.join()
    running.clear()
    watcher.join(10)
    return generation


def wait_until_restored(client: SwarmClient, servers: list[Proc],
                        baseline: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Waits until every server serves the whole segment again with its free pages back at `baseline`, having
    restored at least once (one restore takes back what a drop and a later merge into a larger group dropped);
    gives their `info`."""
    wait_for_ranges(client, {server.peer_id: (0, 8) for server in servers})
    peers = {server.peer_id for server in servers}
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        after = {peer: info for peer, info in infos(client).items() if peer in peers}
        if all(info["record"]["pages_free"] == baseline[peer]["pages_free"] for peer, info in after.items()):
            break
        time.sleep(0.2)
    for peer, info in after.items():
        assert info["record"]["pages_free"] == baseline[peer]["pages_free"]
        assert info["record"]["restorable_start"] is None
        assert info["dropping"]["drops"] >= info["dropping"]["restores"] >= 1
    return after


def test_a_burst_makes_the_segment_drop_admit_more_sessions_with_exact_tokens_and_restore_after(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    """Without an orchestrator (`--kv-dropping`): two replicas whose pages hold two sessions each, beside a third
    server of the segment that takes no part in its drops and has the smallest peer id, take ten at once. Refused
    sessions raise the segment's demand, its leader (the smaller peer id of the two that drop) has both drop half of
    the blocks, all ten sessions are open at the same time, every session ends with the local model's tokens, and
    once the burst is over both restore their blocks and pages; the third kept its range all along."""
    bystander_key, *keys = ordered_identities(swarm_factory.workdir, 3)
    servers = start_dropping_replicas(swarm_factory, tiny_llama, restore_after_s=2, identities=keys)
    bystander = swarm_factory.start_server(tiny_llama, "0:8", *POOL, *SMALL_SESSIONS, "--identity", str(bystander_key))
    local, remote = local_and_remote(swarm_factory, tiny_llama, busy_wait_s=120.0)
    client = remote.swarm
    try:
        wait_for_ranges(client, {server.peer_id: (0, 8) for server in [*servers, bystander]})
        assert bystander.peer_id < min(server.peer_id for server in servers)
        baseline = {peer: info["record"] for peer, info in infos(client).items()}
        prompts = [prompt(seed, 20) for seed in range(10)]
        expected = [local.generate(ids, max_new_tokens=40, do_sample=False).tolist() for ids in prompts]
        # each session waits after its first token until all ten have one: the undropped pools hold six, so the
        # rest open only beside them, once the drop made room (a barrier that times out fails its sessions)
        all_open = threading.Barrier(len(prompts), timeout=TIMEOUT_S * 2)
        generation = Generation(remote, prompts, new_tokens=40, after_first_token=all_open.wait)
        generation.join()
        assert generation.errors == [] and generation.outputs == expected

        # the burst is over: both restore the whole segment, and their pages come back
        after = wait_until_restored(client, servers, baseline)
        leader = min(after)
        assert after[leader]["dropping"]["loop"]["drops"] >= 1 and after[leader]["dropping"]["loop"]["aborts"] == 0
        kept = info_of(client, bystander.peer_id)
        assert (kept["record"]["block_start"], kept["record"]["block_end"], kept["dropping"]["drops"]) == (0, 8, 0)
        assert kept["record"]["segment_dropping"] is False
    finally:
        remote.shutdown()


def test_a_member_that_dies_while_its_group_is_dropped_leaves_no_block_without_a_host(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    """The buddy keeping half of the blocks is killed while eight sessions run through the group, some of them
    victims whose KV moved to it (blocking exchange: their client has no inputs of its part, and replays them from
    the leader's): the leader loads its dropped blocks back at once (evicting the sessions of the broken chain to
    make room), and every session ends on it with the local model's tokens."""
    servers = start_dropping_replicas(swarm_factory, tiny_llama, restore_after_s=600, exchange="blocking")
    survivor, doomed = sorted(servers, key=lambda server: server.peer_id)  # the leader survives
    local, remote = local_and_remote(swarm_factory, tiny_llama, busy_wait_s=120.0)
    client = remote.swarm
    try:
        wait_for_ranges(client, {server.peer_id: (0, 8) for server in servers})
        prompts = [prompt(seed, 20) for seed in range(8)]
        expected = [local.generate(ids, max_new_tokens=40, do_sample=False).tolist() for ids in prompts]
        dropped_at_kill: list[bool] = []

        def kill_doomed() -> None:  # every session is open, so the group has dropped: the undropped pools hold four
            dropped_at_kill.append(all(info["dropping"]["restorable"] for info in infos(client).values()))
            swarm_factory.kill(doomed)

        # the eight sessions wait after their first token until all are open, and the buddy dies before any goes
        # on: every session still has 39 tokens to go through the broken group
        all_open = threading.Barrier(len(prompts), action=kill_doomed, timeout=TIMEOUT_S * 2)
        generation = Generation(remote, prompts, new_tokens=40, after_first_token=all_open.wait)
        generation.join()
        assert dropped_at_kill == [True], "the group had not dropped when all eight sessions were open"
        assert generation.errors == [] and generation.outputs == expected
        info = info_of(client, survivor.peer_id)  # the dead member's record may not have expired yet
        assert (info["record"]["block_start"], info["record"]["block_end"]) == (0, 8)
        assert info["dropping"]["restores"] == 1 and info["dropping"]["restorable"] is None
    finally:
        remote.shutdown()


def test_a_burst_that_arrives_as_the_group_restores_ends_exact_with_every_block_hosted(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    """A first burst makes the group drop (blocking exchange); once the demand fits, the leader restores, and a
    second burst arrives the moment a server reports its restore, while the merges back may still run and before
    the other member restored: every session of both bursts ends with the local model's tokens, no block is ever
    without a host, and the group may drop again for the second burst."""
    servers = start_dropping_replicas(swarm_factory, tiny_llama, restore_after_s=2, exchange="blocking")
    local, remote = local_and_remote(swarm_factory, tiny_llama, busy_wait_s=120.0)
    client = remote.swarm
    try:
        wait_for_ranges(client, {server.peer_id: (0, 8) for server in servers})
        first = [prompt(seed, 20) for seed in range(8)]
        second = [prompt(seed, 20) for seed in range(8, 16)]
        expected = [local.generate(ids, max_new_tokens=24, do_sample=False).tolist() for ids in first + second]
        uncovered: list[float] = []

        def look() -> None:  # every block has an online host at every poll
            records = client.run(client.servers())
            hosted = {block for record in records.values() for block in range(record.block_start, record.block_end)}
            if hosted != set(range(8)):
                uncovered.append(time.monotonic())

        # the first burst's sessions wait after their first token until all eight have one: the undropped pools hold
        # four, so it ends only through a drop [in a loaded suite run, eight that did not wait could end by backing
        # off before the leader's samples showed their demand, and no drop left no restore to wait for]
        all_open = threading.Barrier(len(first), timeout=TIMEOUT_S * 2)
        burst = generate_watching(remote, first, new_tokens=24, look=look, after_first_token=all_open.wait)
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and not any(info["dropping"]["restores"] for info in infos(client).values()):
            time.sleep(0.05)
        assert any(info["dropping"]["restores"] for info in infos(client).values()), \
            "the group never restored:\n" + "\n".join(plan_lines(servers))
        during = generate_watching(remote, second, new_tokens=24, look=look)
        assert burst.errors == [] and during.errors == []
        assert burst.outputs + during.outputs == expected
        assert not uncovered, f"blocks without an online host at {len(uncovered)} poll(s)"
        assert all(info["dropping"]["drops"] >= 1 for info in infos(client).values())
    finally:
        remote.shutdown()


def segment_state(found: dict[str, dict[str, Any]]) -> tuple[int, int, int, int]:
    """Gives (servers dropped, drop plans, restores, pages the newest plan was asked for) of servers whose `info` is
    `found`, the plans and restores summed over their drop loops (the leader's, and any a former leader made)."""
    loops = [info["dropping"]["loop"] for info in found.values()]
    return (sum(info["dropping"]["restorable"] is not None for info in found.values()),
            sum(loop["drops"] for loop in loops), sum(loop["restores"] for loop in loops),
            max(loop["plan_required_pages"] or 0 for loop in loops))


def plan_lines(servers: list[Proc]) -> list[str]:
    """Gives the servers' log lines about drop plans and restores, for a failure's message."""
    return [line for server in servers for line in server.output().splitlines()
            if "drop plan" in line or "restored the segment" in line]


def test_a_burst_that_outgrows_the_first_pair_pairs_the_servers_still_whole_and_one_restore_takes_all_back(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    """Four replicas (`--kv-dropping`) whose pages hold two sessions each; sessions open one by one and stay open.
    The demand's rise pairs two servers (one pair frees what the next second needs), and as it keeps rising the
    leader pairs the two still whole while the first pair stays: two dropped, then four, with no restore between
    (a further rise may merge the pairs into a group of four).
    Every session then ends with the local model's tokens, and a restore brings all four servers' blocks and pages
    back."""
    swarm_factory.start_dht()
    servers = [swarm_factory.start_server(tiny_llama, "0:8", *POOL, *SMALL_SESSIONS, "--kv-dropping",
                                          "--restore-after", "8", "--restore-calm", "2", "--kv-exchange", "blocking",
                                          wait=False)
               for _ in range(4)]
    for server in servers:
        swarm_factory.wait_ready(server)
    local, remote = local_and_remote(swarm_factory, tiny_llama, busy_wait_s=120.0)
    client = remote.swarm
    count = 22  # 8 fit the four whole servers, 20 beside one pair, 30 beside two
    release = threading.Event()
    admitted = [threading.Event() for _ in range(count)]
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def run(index: int, ids: torch.Tensor) -> None:
        def hold() -> None:  # after its first token: the session holds its pages until the burst is complete
            admitted[index].set()
            release.wait(TIMEOUT_S * 4)

        try:
            results[index] = remote.generate(ids, max_new_tokens=24, do_sample=False,
                                             streamer=ActAfterTokens({1: hold})).tolist()
        except BaseException as error:  # the test asserts on it
            errors.append(error)
            admitted[index].set()

    try:
        wait_for_ranges(client, {server.peer_id: (0, 8) for server in servers})
        baseline = {peer: info["record"] for peer, info in infos(client).items()}
        prompts = [prompt(seed, 20) for seed in range(count)]
        expected = [local.generate(ids, max_new_tokens=24, do_sample=False).tolist() for ids in prompts]
        # after each session opened: (servers dropped, the segment's drop plans and restores, the pages the newest
        # plan was asked for), plans and restores summed over the members' loops: whoever led when each was made
        seen: list[tuple[int, int, int, int]] = []
        threads = []
        for index, ids in enumerate(prompts):
            threads.append(threading.Thread(target=run, args=(index, ids), daemon=True))
            threads[-1].start()
            # one session at a time, half a second apart: the demand rises by one session's pages a second
            assert admitted[index].wait(TIMEOUT_S * 2), f"session {index} was never admitted"
            time.sleep(0.5)
            seen.append(segment_state(infos(client)))
        release.set()
        for thread in threads:
            thread.join(TIMEOUT_S * 4)
        assert errors == [] and [results.get(index) for index in range(count)] == expected
        # four servers dropped by two plans and no restore: the first paired two, the second the two still whole
        # (both plans may fall between two samples, so the state with one pair need not be seen, and a third plan
        # may merge the pairs before the next sample). One plan may pair all four at once, but only when it was
        # asked for more than one pair frees (a member's parameter pages).
        pair_frees = next(iter(baseline.values()))["pages_params"]
        assert any(dropped == 4 and restores == 0 and (plans >= 2 or (plans == 1 and required > pair_frees))
                   for dropped, plans, restores, required in seen), (
            f"no pair joined a pair without a restore: {seen}; the servers' plans: {plan_lines(servers)}")

        after = wait_until_restored(client, servers, baseline)
        _, plans, restores, _ = segment_state(after)
        assert restores >= 1 and plans >= 1 and not after[min(after)]["dropping"]["loop"]["dropped"], (
            plans, restores, plan_lines(servers))
    finally:
        release.set()
        remote.shutdown()


def test_two_pairs_merge_into_a_group_of_four_mid_generation_and_a_restore_takes_every_block_back(
    swarm_factory: SwarmProcesses, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deeper drop (`plan_merge`): two pairs become one group of four, each member keeping half of its slice; the
    running session's KV for the blocks its servers gave up moves to the members that keep them, and it goes on
    through four servers without a replay; the restore brings every block back, takes the session's parts back
    into the server of its first part, last part first, and, once it closed, every page is back in its pool.

    After the restore the client asks for each pushed step's outputs late, as a loaded client does: a merge then
    takes two parts together after both ran the step, and the client follows the merged part one step behind it."""
    late = threading.Event()
    call_step = RemoteInferenceSession.call_step

    async def late_collect(self: RemoteInferenceSession, span_session: Any, hidden: torch.Tensor | None,
                           **kwargs: Any) -> torch.Tensor:
        if hidden is None and late.is_set():  # a pushed step's output, asked for after the servers ran it
            await asyncio.sleep(LATE_COLLECT_S)
        return await call_step(self, span_session, hidden, **kwargs)

    monkeypatch.setattr(RemoteInferenceSession, "call_step", late_collect)
    swarm_factory.start_dht()
    local, remote = local_and_remote(swarm_factory, tiny_llama)
    client = remote.swarm
    orchestrator = client.p2p.peer_id.to_base58()
    try:
        servers = [swarm_factory.start_server(tiny_llama, "0:8", "--orchestrator", orchestrator, "--kv-exchange",
                                              "blocking", wait=False) for _ in range(4)]
        for server in servers:
            swarm_factory.wait_ready(server)
        peers = [server.peer_id for server in servers]
        wait_for_ranges(client, {peer: (0, 8) for peer in peers})
        baseline = {peer: info["record"] for peer, info in infos(client).items() if peer in peers}
        input_ids = prompt(6, 20)
        expected = local.generate(input_ids, max_new_tokens=40, do_sample=False)
        kept: dict[str, tuple[int, int]] = {}
        first_server: list[str] = []  # the member that keeps 0:2 in the group of four

        with remote.inference_session(max_length=64) as session:

            def drop(ranges: dict[str, tuple[int, int]]) -> None:
                for peer, blocks in sorted(ranges.items()):
                    call(client, peer, "drop", {"blocks": list(blocks)})
                kept.update(ranges)
                wait_for_ranges(client, dict(kept))
                wait_until_reshaped(client, peers)

            def into_pairs() -> None:
                first = session.route[0].peer_id  # the session runs here
                others = sorted(set(peers) - {first})
                drop({first: (0, 4), others[0]: (4, 8), others[1]: (0, 4), others[2]: (4, 8)})

            def into_four() -> None:
                replicas = [SegmentReplica(peer, 0, 8, 1) for peer in peers]
                plan = plan_merge(replicas, groups_of(replicas, kept), kept, required_pages=1)
                assert [group.size for group in plan.groups] == [4]
                drop(dict(plan.kept))

            def restore_all() -> None:
                # the session went on through the four members, each over the slice it keeps
                assert [(span.start, span.end) for span in session.route] == [(0, 2), (2, 4), (4, 6), (6, 8)]
                assert [kept[span.peer_id] for span in session.route] == [(0, 2), (2, 4), (4, 6), (6, 8)]
                first_server.append(session.route[0].peer_id)
                for peer in peers:
                    call(client, peer, "restore", {})
                kept.clear()
                wait_for_ranges(client, {peer: (0, 8) for peer in peers})
                late.set()

            actual = remote.generate(input_ids, session=session, max_new_tokens=40, do_sample=False,
                                     streamer=ActAfterTokens({3: into_pairs, 6: into_four, 9: restore_all}))
            assert session.failovers == 0  # every move carried the KV: no replay
            # the restore took the parts back tail first, each into the server before it: one server runs it all
            assert [(span.start, span.end) for span in session.route] == [(0, 8)]
            assert session.route[0].peer_id == first_server[0]
        assert actual.tolist() == expected.tolist()

        for info in wait_until_reshaped(client, peers).values():
            record = info["record"]
            assert (record["block_start"], record["block_end"]) == (0, 8) and record["restorable_start"] is None
            assert info["dropping"]["drops"] in (1, 2) and info["dropping"]["restores"] == 1
            assert info["dropping"]["exchange"]["replayed"] == 0
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:  # the session closed: every page is back in its pool
            records = {peer: info["record"] for peer, info in infos(client).items() if peer in peers}
            if all(records[peer]["pages_free"] == baseline[peer]["pages_free"] for peer in peers):
                break
            time.sleep(0.2)
        assert {peer: records[peer]["pages_free"] for peer in peers} == {
            peer: baseline[peer]["pages_free"] for peer in peers}
    finally:
        remote.shutdown()
