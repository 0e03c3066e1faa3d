"""Servers batch the steps of concurrent sessions: every session's greedy tokens stay those of the local model for
its prompt alone, a long prefill shares batches with decode steps, and bad or dying sessions fail alone."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from client import DistributedModelForCausalLM, SwarmClient
from swarm.errors import InvalidTensor, ServerBusy, SwarmError
from swarm.local_swarm import SwarmProcesses
from swarm.records import ServerRecord
from swarm.rpc import RpcConnection
from swarm.wire import encode_tensor
from tests.test_swarm_generate import start_swarm
from tests.tiny_models import write_tiny_checkpoint

pytestmark = pytest.mark.slow
HIDDEN = 64
TIMEOUT_S = 60.0
# Sliding windows shorter than the sessions, so that they are exercised end to end.
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 12},
    "qwen2": {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 4,
              "layer_types": ["full_attention"] * 4 + ["sliding_attention"] * 4},
}


def prompts(count: int, seed: int) -> list[torch.Tensor]:
    """Gives `count` prompts of different lengths (3, 5, 7, ...)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (1, 3 + 2 * index), generator=generator) for index in range(count)]


def generate_concurrently(
    model: DistributedModelForCausalLM, inputs: list[torch.Tensor], *, max_new_tokens: int, stagger_s: float
) -> tuple[list[list[int]], list[float]]:
    """Gives each prompt's greedy output, generated in a thread of its own started `stagger_s` after the previous
    one, and when each thread finished (monotonic seconds)."""
    outputs: dict[int, list[int]] = {}
    finished: dict[int, float] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            time.sleep(index * stagger_s)
            output = model.generate(inputs[index], max_new_tokens=max_new_tokens, do_sample=False)
            outputs[index] = output[0].tolist()
            finished[index] = time.monotonic()
        except BaseException as error:  # surfaced below; a thread cannot fail the test itself
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TIMEOUT_S * 3)
    assert not errors, errors
    return [outputs[index] for index in range(len(inputs))], [finished[index] for index in range(len(inputs))]


def local_greedy(path: Path, inputs: list[torch.Tensor], max_new_tokens: int | list[int]) -> list[list[int]]:
    """Gives the local model's greedy output for each prompt: `max_new_tokens` new tokens, or as many as listed."""
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    counts = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(inputs)
    return [local.generate(ids, max_new_tokens=count, do_sample=False)[0].tolist()
            for ids, count in zip(inputs, counts, strict=True)]


def infos(client: SwarmClient) -> dict[int, dict[str, Any]]:
    """Gives every server's `info` reply, by the first block it hosts."""
    replies = {}
    for record in client.run(client.servers()).values():
        connection = client.run(client.connect(record))
        try:
            replies[record.block_start] = client.run(connection.call("info", {}, timeout=TIMEOUT_S))
        finally:
            client.run(connection.close())
    return replies


def multi_step_batches(reply: dict[str, Any]) -> int:
    """Gives how many batches of a server's `info` computed more than one step."""
    return sum(count for bound, count in reply["batches"]["steps_per_batch"].items() if bound != "<=1")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eight_sessions_started_at_different_moments_each_match_the_local_model(
    family: str, tmp_path: Path
) -> None:
    path = write_tiny_checkpoint(family, tmp_path / family, **FAMILIES[family])
    inputs = prompts(8, seed=len(family))
    with SwarmProcesses(tmp_path / "swarm") as swarm:
        start_swarm(swarm, path, ["0:3", "3:6", "6:8"])
        model = DistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers)
        try:
            outputs, _ = generate_concurrently(model, inputs, max_new_tokens=16, stagger_s=0.02)
            replies = infos(model.swarm)
            frames = model.swarm.step_frames
        finally:
            model.shutdown()
    assert outputs == local_greedy(path, inputs, 16)
    assert frames.framed_steps > frames.frames > 0  # sessions that went on together sent their steps in one frame
    assert sum(multi_step_batches(reply) for reply in replies.values()) > 0, replies  # the steps shared batches
    assert all(reply["record"]["pages_kv"] == 0 for reply in replies.values())  # every page went back


class RawSession:
    """A session a test drives by hand on one server, as a misbehaving client would."""

    def __init__(self, client: SwarmClient, record: ServerRecord, *, max_length: int) -> None:
        self.client = client
        self.connection: RpcConnection = client.run(client.connect(record))
        blocks = [record.block_start, record.block_end]
        self.session_id = self.call("open", {"blocks": blocks, "max_length": max_length})["session_id"]

    def call(self, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        return self.client.run(self.connection.call(method, payload, timeout=TIMEOUT_S))

    def step(self, tokens: int) -> dict[str, Any]:
        hidden = encode_tensor(torch.ones(1, tokens, HIDDEN))
        return self.call("step", {"session_id": self.session_id, "hidden": hidden})


@pytest.fixture(scope="module")
def paged_swarm(swarm_factory: SwarmProcesses, tiny_llama: Path) -> Iterator[DistributedModelForCausalLM]:
    # 4 KiB pages hold 16 tokens of the tiny model; 1.5 MiB leave the first server 273 KV pages next to its 3
    # blocks (37 pages each). Batches of at most 16 tokens: a long prompt takes many.
    flags = ["--page-size", "4KiB", "--memory", "1.5MiB", "--max-length", "2048", "--max-batch-tokens", "16"]
    start_swarm(swarm_factory, tiny_llama, ["0:3", "3:6", "6:8"], dict.fromkeys(["0:3", "3:6", "6:8"], flags))
    model = DistributedModelForCausalLM.from_pretrained(str(tiny_llama), initial_peers=swarm_factory.initial_peers)
    try:
        yield model
    finally:
        model.shutdown()


def first_server(model: DistributedModelForCausalLM) -> ServerRecord:
    return next(r for r in model.swarm.run(model.swarm.servers()).values() if r.block_start == 0)


class UntilOver(StoppingCriteria):
    """Stops a greedy generation once `over` is set, after at least `min_new_tokens`; sets `decoding` once it has
    decoded a few tokens."""

    def __init__(self, prompt_length: int, over: threading.Event, *, min_new_tokens: int = 4) -> None:
        self.prompt_length, self.over, self.min_new_tokens = prompt_length, over, min_new_tokens
        self.decoding = threading.Event()
        self.stopped_by_over = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object) -> torch.BoolTensor:
        new_tokens = input_ids.shape[1] - self.prompt_length
        if new_tokens >= 2:
            self.decoding.set()
        stop = self.over.is_set() and new_tokens >= self.min_new_tokens
        self.stopped_by_over |= stop
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool)


def while_four_sessions_run(
    model: DistributedModelForCausalLM, tiny_llama: Path, disturb: Callable[[], None], *, max_new_tokens: int = 240
) -> None:
    """Runs `disturb` while four sessions generate, which stop only once it is over; checks that each of them kept
    the local model's tokens."""
    inputs = prompts(4, seed=7)
    over = threading.Event()
    criteria = [UntilOver(ids.shape[1], over) for ids in inputs]
    outputs: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            output = model.generate(inputs[index], max_new_tokens=max_new_tokens, do_sample=False,
                                    stopping_criteria=StoppingCriteriaList([criteria[index]]))
            outputs[index] = output[0].tolist()
        except BaseException as error:  # surfaced below; a thread cannot fail the test itself
            errors.append(error)
        finally:
            criteria[index].decoding.set()  # a failed session must not hold the test up

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(inputs))]
    for thread in threads:
        thread.start()
    try:
        for criterion in criteria:
            assert criterion.decoding.wait(TIMEOUT_S), "the four sessions did not start decoding"
        disturb()
    finally:
        over.set()
        for thread in threads:
            thread.join(timeout=TIMEOUT_S * 3)
    assert not errors, errors
    assert all(criterion.stopped_by_over for criterion in criteria), "a session ended before the disturbance did"
    generated = [outputs[index] for index in range(len(inputs))]
    new_tokens = [len(output) - ids.shape[1] for output, ids in zip(generated, inputs, strict=True)]
    assert generated == local_greedy(tiny_llama, inputs, new_tokens)


def assert_pools_back_to_baseline(model: DistributedModelForCausalLM) -> None:
    for _ in range(50):  # a closed stream frees its session asynchronously
        replies = infos(model.swarm)
        if all(reply["record"]["pages_kv"] == 0 and reply["record"]["session_count"] == 0
               for reply in replies.values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"pages still held: {[(b, r['record']['pages_kv']) for b, r in replies.items()]}")


def test_a_long_prefill_shares_batches_with_decoding_sessions(paged_swarm, tiny_llama: Path) -> None:
    def mixed_batches() -> int:
        return sum(reply["batches"]["mixed"] for reply in infos(paged_swarm.swarm).values())

    before = mixed_batches()
    # 320 tokens: 21 pages a block with its 4 new ones, which the first server's 273 KV pages admit next to the
    # four sessions' expected growth (the headroom rule counts the announced prompt)
    long_prompt = torch.randint(3, 128, (1, 320), generator=torch.Generator().manual_seed(11))
    generated: list[list[int]] = []

    def long_prefills() -> None:
        # How many chunks meet a decode step depends on how the OS schedules eight processes on two cores (the
        # scheduler's own tests pin it down); a few prompts in a row make the count robust.
        for _ in range(3):
            generated.append(paged_swarm.generate(long_prompt, max_new_tokens=4, do_sample=False)[0].tolist())
            if mixed_batches() - before >= 3:
                return

    while_four_sessions_run(paged_swarm, tiny_llama, long_prefills)
    assert generated == local_greedy(tiny_llama, [long_prompt], 4) * len(generated)
    mixed = mixed_batches() - before
    assert mixed >= 3, "the prompts' chunks (20 per server each) should have shared batches with the decode steps"
    assert_pools_back_to_baseline(paged_swarm)


def test_a_steps_frame_computes_its_sessions_together_and_a_bad_one_fails_alone(paged_swarm) -> None:
    server = first_server(paged_swarm)
    raws = [RawSession(paged_swarm.swarm, server, max_length=64) for _ in range(3)]
    for raw in raws:
        raw.step(5)
    before = infos(paged_swarm.swarm)[0]["batches"]["steps_per_batch"].get("<=2", 0)
    generator = torch.Generator().manual_seed(5)
    good = [torch.randn(1, 1, HIDDEN, generator=generator) for _ in range(2)]
    frame = [{"session_id": raws[0].session_id, "step_id": "5", "hidden": encode_tensor(good[0])},
             {"session_id": raws[1].session_id, "step_id": "5", "hidden": encode_tensor(torch.ones(1, 1, HIDDEN + 1))},
             {"session_id": raws[2].session_id, "step_id": "5", "hidden": encode_tensor(good[1])},
             "not a step"]
    results = raws[0].call("steps", {"steps": frame})["results"]
    assert [result["position"] for result in results[0:3:2]] == [6, 6]
    assert [results[1]["error"]["code"], results[3]["error"]["code"]] == ["InvalidTensor", "MalformedFrame"]
    assert infos(paged_swarm.swarm)[0]["batches"]["steps_per_batch"].get("<=2", 0) == before + 1  # one batch of 2
    assert raws[1].step(1)["position"] == 6  # the session of the bad step goes on
    for raw in raws:
        paged_swarm.swarm.run(raw.connection.close())
    assert_pools_back_to_baseline(paged_swarm)


def test_a_bad_step_fails_alone(paged_swarm, tiny_llama: Path) -> None:
    def bad_steps() -> None:
        raw = RawSession(paged_swarm.swarm, first_server(paged_swarm), max_length=64)
        with pytest.raises(InvalidTensor):
            raw.call("step", {"session_id": raw.session_id, "hidden": encode_tensor(torch.ones(1, 2, HIDDEN + 1))})
        with pytest.raises(InvalidTensor):
            raw.call("step", {"session_id": raw.session_id, "hidden": encode_tensor(torch.ones(1, 2, HIDDEN).int())})
        assert raw.step(3)["position"] == 3  # the session itself is intact too
        paged_swarm.swarm.run(raw.connection.close())

    while_four_sessions_run(paged_swarm, tiny_llama, bad_steps)
    assert_pools_back_to_baseline(paged_swarm)


def test_a_session_killed_mid_batch_frees_its_pages_and_others_go_on(paged_swarm, tiny_llama: Path) -> None:
    def failed_steps() -> int:
        return infos(paged_swarm.swarm)[0]["batches"]["steps_failed"].get("SessionNotFound", 0)

    dropped_before = failed_steps()

    def killed_mid_prefill() -> None:
        raw = RawSession(paged_swarm.swarm, first_server(paged_swarm), max_length=2048)
        client = paged_swarm.swarm
        payload = {"session_id": raw.session_id, "hidden": encode_tensor(torch.ones(1, 1000, HIDDEN))}
        pending = asyncio.run_coroutine_threadsafe(
            raw.connection.call("step", payload, timeout=TIMEOUT_S), client.background.loop
        )
        time.sleep(0.03)  # its prefill is being computed, 16 tokens per batch
        client.run(raw.connection.close())  # the client dies: its stream closes
        with pytest.raises(SwarmError):  # its own call ends with the stream
            pending.result(timeout=TIMEOUT_S)

    while_four_sessions_run(paged_swarm, tiny_llama, killed_mid_prefill)
    assert failed_steps() == dropped_before + 1  # its prefill stopped between two chunks when the session closed
    assert_pools_back_to_baseline(paged_swarm)


def test_a_session_that_runs_out_of_pages_fails_alone(paged_swarm, tiny_llama: Path) -> None:
    def out_of_pages() -> None:
        raw = RawSession(paged_swarm.swarm, first_server(paged_swarm), max_length=2048)
        raw.step(200)  # 13 pages per block
        with pytest.raises(ServerBusy, match="out of KV pages"):
            raw.step(1800)  # 112 more per block: the pool has fewer, and nobody else's pages are taken
        assert raw.step(10)["position"] == 210  # the session itself goes on
        raw.call("close", {"session_id": raw.session_id})

    while_four_sessions_run(paged_swarm, tiny_llama, out_of_pages)
    assert_pools_back_to_baseline(paged_swarm)
