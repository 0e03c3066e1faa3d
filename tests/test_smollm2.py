"""The embedded default model: SmolLM2-135M-Instruct through 3 servers generates what it generates locally, also
when a session's KV moves to another server mid-generation."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from client import ClientConfig, DistributedModelForCausalLM
from swarm.local_swarm import SwarmProcesses, threads_per_server
from swarm.model import DEFAULT_MODEL, resolve_model
from tests.test_batching import generate_concurrently, infos, multi_step_batches
from tests.test_failover import ActAfterTokens
from tests.test_migration import infos as infos_by_peer
from tests.test_migration import other_host
from tests.test_swarm_generate import start_swarm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_swarm(swarm_factory: SwarmProcesses) -> SwarmProcesses:
    source = resolve_model(DEFAULT_MODEL)  # converts the bundled GGUF once into the cache
    swarm_factory.torch_threads = threads_per_server(3)  # as the demo starts them
    start_swarm(swarm_factory, source.path, ["0:10", "10:20", "20:30"])
    for server in (proc for proc in swarm_factory.procs if proc.name != "dht"):
        assert f"on {threads_per_server(3)} torch thread(s)" in server.output(), server.output()[-2000:]
    return swarm_factory


@pytest.fixture(scope="module")
def local_smollm2() -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(resolve_model(DEFAULT_MODEL).path, dtype=torch.float32).eval()


def chat(tokenizer: AutoTokenizer, question: str) -> torch.Tensor:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]


def test_smollm2_chat_through_three_servers_matches_local_generate(
    smollm2_swarm: SwarmProcesses, local_smollm2: AutoModelForCausalLM, capsys: pytest.CaptureFixture[str]
) -> None:
    source = resolve_model(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    input_ids = chat(tokenizer, "What is the capital of France?")
    expected = local_smollm2.generate(input_ids, max_new_tokens=24, do_sample=False)
    remote = DistributedModelForCausalLM.from_pretrained(DEFAULT_MODEL, initial_peers=smollm2_swarm.initial_peers)
    try:
        with remote.inference_session(max_length=input_ids.shape[1] + 24) as session:
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
            actual = remote.generate(input_ids, session=session, max_new_tokens=24, do_sample=False, streamer=streamer)
            assert [(span.start, span.end) for span in session.route] == [(0, 10), (10, 20), (20, 30)]
    finally:
        remote.shutdown()
    assert actual.tolist() == expected.tolist()
    reply = tokenizer.decode(actual[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply
    assert reply.strip() in capsys.readouterr().out


QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Name three colours.",
    "Why is the sky blue? Answer in one sentence.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me a synonym for happy, and explain why it fits.",
    "Explain in two sentences what a transformer model is and why it is used for language.",
]


def test_eight_concurrent_smollm2_sessions_each_match_the_local_model(
    smollm2_swarm: SwarmProcesses, local_smollm2: AutoModelForCausalLM
) -> None:
    source = resolve_model(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    prompts = [chat(tokenizer, question) for question in QUESTIONS]
    assert len({ids.shape[1] for ids in prompts}) == len(prompts)  # every prompt has its own length
    expected = [local_smollm2.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist() for ids in prompts]
    remote = DistributedModelForCausalLM.from_pretrained(DEFAULT_MODEL, initial_peers=smollm2_swarm.initial_peers)
    try:
        outputs, _ = generate_concurrently(remote, prompts, max_new_tokens=12, stagger_s=0.05)
        replies = infos(remote.swarm)
    finally:
        remote.shutdown()
    assert outputs == expected
    assert all(multi_step_batches(reply) > 0 for reply in replies.values())  # every server batched their steps


@pytest.mark.parametrize("push", [True, False], ids=["push", "no-push"])
def test_smollm2_sessions_move_by_kv_and_by_replay_mid_generation_and_tokens_match(
    smollm2_swarm: SwarmProcesses, local_smollm2: AutoModelForCausalLM, push: bool
) -> None:
    """The middle span moves to a twin server with its KV after the 4th token and back by a replay after the 10th:
    the tokens stay the local model's, no step fails over, and every pool ends at its baseline. (Last in the
    module: the twin joins the swarm the tests above ran on.)"""
    source = resolve_model(DEFAULT_MODEL)
    twin = next((proc for proc in smollm2_swarm.procs if proc.name == "server-10-20-twin"), None)
    twin = twin or smollm2_swarm.start_server(source.path, "10:20", name="server-10-20-twin")
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    input_ids = chat(tokenizer, "Name three colours.")
    expected = local_smollm2.generate(input_ids, max_new_tokens=16, do_sample=False)
    remote = DistributedModelForCausalLM.from_pretrained(
        DEFAULT_MODEL, initial_peers=smollm2_swarm.initial_peers, client_config=ClientConfig(server_push=push))
    try:
        client = remote.swarm
        deadline = time.monotonic() + 30
        while twin.peer_id not in client.run(client.servers()):  # its record reaches the client's DHT view
            assert time.monotonic() < deadline, "the twin server never showed in the DHT"
            time.sleep(0.2)
        baseline = {peer: info["record"]["pages_free"] for peer, info in infos_by_peer(client).items()}
        before = {peer: info["migrations"] for peer, info in infos_by_peer(client).items()}
        moved: list[tuple[str, str, str]] = []
        with remote.inference_session(max_length=input_ids.shape[1] + 16) as session:

            def move(mode: str) -> Callable[[], None]:
                def act() -> None:
                    origin = session.route[1].peer_id
                    destination = other_host(client, origin)
                    assert session.migrate(1, destination, mode=mode)["mode"] == mode
                    assert session.route[1].peer_id == destination
                    moved.append((origin, destination, mode))

                return act

            streamer = ActAfterTokens({4: move("kv"), 10: move("replay")})
            actual = remote.generate(input_ids, session=session, max_new_tokens=16, do_sample=False,
                                     streamer=streamer)
            assert (session.moves, session.failovers) == (2, 0)
        assert actual.tolist() == expected.tolist()
        replies = infos_by_peer(client)
        for origin, destination, mode in moved:
            assert replies[origin]["migrations"]["out"][mode] == before[origin]["out"][mode] + 1
            assert replies[destination]["migrations"]["in"][mode] == before[destination]["in"][mode] + 1
        assert {peer: info["record"]["pages_free"] for peer, info in replies.items()} == baseline
    finally:
        remote.shutdown()
