"""A real swarm of tiny-model servers on loopback gives the same logits and tokens as the local HF model."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from client import ClientConfig, DistributedModelForCausalLM
from client.timing import StepClock
from swarm.local_swarm import SwarmProcesses

pytestmark = pytest.mark.slow


def start_swarm(
    swarm: SwarmProcesses, model: Path, block_ranges: list[str], extra_args: dict[str, list[str]] | None = None
) -> None:
    swarm.start_dht()
    extra_args = extra_args or {}
    servers = [swarm.start_server(model, blocks, *extra_args.get(blocks, []), wait=False) for blocks in block_ranges]
    for server in servers:
        swarm.wait_ready(server)


def prompt(seed: int, length: int = 9) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama_local(tiny_llama: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama_remote(swarm_factory: SwarmProcesses, tiny_llama: Path) -> Iterator[DistributedModelForCausalLM]:
    # Two servers compute every step on their compute pool, two on their event loop (short steps, one at a time):
    # each chain, and each concurrent test, goes through both paths.
    pool_only = ["--inline-step-ms", "0"]
    start_swarm(swarm_factory, tiny_llama, ["0:2", "2:4", "4:6", "6:8"], {"0:2": pool_only, "4:6": pool_only})
    model = DistributedModelForCausalLM.from_pretrained(str(tiny_llama), initial_peers=swarm_factory.initial_peers)
    try:
        yield model
    finally:
        model.shutdown()


class TokenCollector(BaseStreamer):
    """Collects what generate() streams, as a user's streamer would see it."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.tokens.extend(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


def test_logits_match_local_model_through_four_servers(llama_remote, llama_local) -> None:
    input_ids = prompt(0, 12)
    with torch.no_grad():
        expected = llama_local(input_ids).logits
    actual = llama_remote(input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    with llama_remote.inference_session(max_length=32) as session:
        llama_remote.generate(input_ids, session=session, max_new_tokens=1)
        assert [span.peer_id for span in session.route] and len(session.route) == 4


def test_a_step_for_the_last_token_only_gets_one_row_back_equal_to_the_full_steps_last(llama_remote) -> None:
    """generate() keeps only the last token's logits, so its prompt step asks the last server for that row alone."""
    hidden = llama_remote.head.embed(prompt(8, 12))
    with llama_remote.inference_session(max_length=16) as full, llama_remote.inference_session(max_length=16) as last:
        every_row = full.step(hidden)
        last_row = last.step(hidden, last_only=True)
        assert last_row.shape == (1, 1, every_row.shape[-1]) and last.position == full.position == 12
        torch.testing.assert_close(last_row, every_row[:, -1:], rtol=0, atol=0)
        assert last.step(every_row[:, -1:]).shape == (1, 1, every_row.shape[-1])  # the session goes on from there


def test_greedy_tokens_match_local_model(llama_remote, llama_local) -> None:
    for seed in (1, 2):
        input_ids = prompt(seed)
        expected = llama_local.generate(input_ids, max_new_tokens=16, do_sample=False)
        actual = llama_remote.generate(input_ids, max_new_tokens=16, do_sample=False)
        assert actual.tolist() == expected.tolist()


def test_sampling_with_seed_matches_local_model(llama_remote, llama_local) -> None:
    input_ids = prompt(3)
    torch.manual_seed(1234)
    expected = llama_local.generate(input_ids, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20)
    torch.manual_seed(1234)
    actual = llama_remote.generate(input_ids, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20)
    assert actual.tolist() == expected.tolist()


def test_eos_stops_generation_like_local_model(llama_remote, llama_local) -> None:
    input_ids = prompt(4)
    greedy = llama_local.generate(input_ids, max_new_tokens=10, do_sample=False)
    eos = int(greedy[0, input_ids.shape[1] + 2])  # the third generated token becomes end-of-sequence
    expected = llama_local.generate(input_ids, max_new_tokens=10, do_sample=False, eos_token_id=eos)
    actual = llama_remote.generate(input_ids, max_new_tokens=10, do_sample=False, eos_token_id=eos)
    assert actual.tolist() == expected.tolist()
    assert actual.shape[1] < greedy.shape[1]


def test_streamer_receives_the_generated_tokens(llama_remote) -> None:
    input_ids = prompt(5)
    streamer = TokenCollector()
    output = llama_remote.generate(input_ids, max_new_tokens=6, do_sample=False, streamer=streamer)
    assert streamer.ended
    assert streamer.tokens == output[0].tolist()  # the prompt first, then each new token


def test_multi_turn_session_sends_only_new_tokens_and_matches_local(llama_remote, llama_local) -> None:
    first_turn, second_turn = prompt(6), prompt(7, 4)
    with llama_remote.inference_session(max_length=64) as session:
        first = llama_remote.generate(first_turn, session=session, max_new_tokens=5, do_sample=False)
        held_after_first = session.position
        second = llama_remote.generate(second_turn, session=session, max_new_tokens=5, do_sample=False)
        assert held_after_first == first.shape[1] - 1  # the last token is only sent with the next turn
        assert session.position == first.shape[1] + second.shape[1] - 1
    history = torch.cat([first, second_turn], dim=1)
    expected = llama_local.generate(history, max_new_tokens=5, do_sample=False)
    assert second.tolist() == expected[:, first.shape[1]:].tolist()


def test_session_timings_cover_every_server_and_the_chains_compute(llama_remote) -> None:
    with llama_remote.inference_session(max_length=32) as session:
        llama_remote.generate(prompt(6), session=session, max_new_tokens=4, do_sample=False)
        timings, route = session.timings(), session.route
    assert [span.peer_id for span in timings] == [span.peer_id for span in route]
    steps = 4  # the prompt, then 3 decode steps (the 4th token is generated but never sent)
    assert all(span.steps == steps for span in timings)
    for span in timings:
        assert 0 < span.compute_ms <= span.round_trip_ms
    # A step's last output cannot reach the client before every server of the chain computed its part.
    assert timings[-1].output_at_ms >= sum(span.compute_ms for span in timings)
    # The prompt went span by span: each server's reply came before the next server was sent it.
    stamps = [(span.first_sent_s, span.first_received_s) for span in timings]
    assert all(sent is not None and received is not None and sent < received for sent, received in stamps)
    assert all(stamps[i][1] <= stamps[i + 1][0] for i in range(len(stamps) - 1))


def test_a_sessions_decode_steps_split_their_time_on_the_clients_side(llama_remote) -> None:
    clock = StepClock()
    with llama_remote.inference_session(max_length=32) as session:
        started = time.perf_counter()
        llama_remote.generate(prompt(6), session=session, max_new_tokens=6, do_sample=False, streamer=clock)
        took_ms = (time.perf_counter() - started) * 1000
        times = session.step_times
    assert times.steps == 5  # the prompt's step gives the first token, a decode step each of the next five
    parts = [times.to_loop_ms, times.gate_ms, times.swarm_ms, times.to_thread_ms, times.head_ms, times.between_ms]
    assert min(parts) >= 0 and times.swarm_ms > 0 and times.head_ms > 0 and times.between_ms > 0
    assert sum(parts) <= took_ms  # the decode steps, one after another, inside the whole generate() call
    # and they account for the time from the first token to the last
    decode_ms = (clock.stamps_s[-1] - clock.stamps_s[1]) * 1000
    assert sum(parts) >= 0.9 * decode_ms


def test_concurrent_sessions_each_match_local_model(llama_remote, llama_local) -> None:
    prompts = [prompt(10 + i) for i in range(3)]
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def generate(index: int) -> None:
        try:
            results[index] = llama_remote.generate(prompts[index], max_new_tokens=10, do_sample=False).tolist()
        except BaseException as error:  # surfaced below; a thread cannot fail the test itself
            errors.append(error)

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    for index, input_ids in enumerate(prompts):
        assert results[index] == llama_local.generate(input_ids, max_new_tokens=10, do_sample=False).tolist()


def test_an_idle_session_does_not_stall_others(llama_remote, llama_local) -> None:
    idle_prompt, busy_prompt = prompt(20), prompt(21)
    with llama_remote.inference_session(max_length=40) as idle:
        llama_remote.generate(idle_prompt, session=idle, max_new_tokens=2, do_sample=False)
        busy = llama_remote.generate(busy_prompt, max_new_tokens=8, do_sample=False)  # while `idle` holds its KV
        assert busy.tolist() == llama_local.generate(busy_prompt, max_new_tokens=8, do_sample=False).tolist()
        resumed = llama_remote.generate(prompt(22, 3), session=idle, max_new_tokens=3, do_sample=False)
    assert resumed.shape[1] == 6



def test_short_steps_compute_on_the_event_loop_unless_disabled(llama_remote, llama_local) -> None:
    input_ids = prompt(30)
    assert llama_remote.generate(input_ids, max_new_tokens=4, do_sample=False).tolist() == \
        llama_local.generate(input_ids, max_new_tokens=4, do_sample=False).tolist()
    swarm = llama_remote.swarm
    records = swarm.run(swarm.servers()).values()
    computed: dict[int, dict[str, int]] = {}
    for record in records:
        connection = swarm.run(swarm.connect(record))
        try:
            computed[record.block_start] = swarm.run(connection.call("info", {}, timeout=30))["steps_computed"]
        finally:
            swarm.run(connection.close())
    # Servers 0:2 and 4:6 run with --inline-step-ms 0; the tiny model's steps are short enough for the others' loops.
    for start in (0, 4):
        assert computed[start]["loop"] == 0 and computed[start]["pool"] >= 5, computed
    for start in (2, 6):
        assert computed[start]["loop"] >= 5, computed


def test_fp16_transport_compression_stays_close(llama_remote, llama_local, swarm_factory, tiny_llama: Path) -> None:
    compressed = DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama), initial_peers=swarm_factory.initial_peers, client_config=ClientConfig(compression="fp16")
    )
    try:
        input_ids = prompt(40, 12)
        with torch.no_grad():
            expected = llama_local(input_ids).logits
        actual = compressed(input_ids).logits
        assert not torch.equal(actual, expected)  # hidden states really crossed the wire as fp16
        torch.testing.assert_close(actual, expected, rtol=0, atol=0.05 * float(expected.abs().max()))
    finally:
        compressed.shutdown()
