"""`swarm-api` against a SmolLM2 swarm, through the official `openai` client: greedy chat and text completions equal
the local model's, streaming, stop sequences, seeds, concurrent requests batched on the servers, a client that
leaves mid-stream, OpenAI error objects (400, 404, 503, 504), and the live swarm page in a real Chromium."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
import torch
from playwright.sync_api import sync_playwright
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from client.swarm_client import ClientConfig, SwarmClient
from swarm.local_swarm import SwarmProcesses
from swarm.model import DEFAULT_MODEL, resolve_model
from swarm.temp_files import bound_socket_files
from tests.prometheus import metrics_url, scrape, value
from tests.test_batching import infos, multi_step_batches
from tests.test_swarm_generate import start_swarm

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"
CHROMIUM = "/usr/bin/chromium"  # Debian's; `scripts/test` installs it when missing
WAIT_S = 60.0


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_model(DEFAULT_MODEL).path


@pytest.fixture(scope="module")
def swarm(swarm_factory: SwarmProcesses, smollm2: Path) -> SwarmProcesses:
    swarm_factory.torch_threads = 1
    metrics = ["--metrics-port", "0"]
    start_swarm(swarm_factory, smollm2, ["0:15", "15:30"], {"0:15": metrics, "15:30": metrics})
    return swarm_factory


@pytest.fixture(scope="module")
def api_url(swarm: SwarmProcesses) -> str:
    _proc, url = swarm.start_api(DEFAULT_MODEL, "--route-wait", "1")
    return url


@pytest.fixture(scope="module")
def api(api_url: str) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    yield client
    client.close()


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def local(smollm2: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


def local_greedy(local: Any, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], max_new_tokens: int
                 ) -> tuple[str, int]:
    """Gives the local model's greedy text after `prompt_ids`, and how many tokens it generated."""
    output = local.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    new = output[0, len(prompt_ids):]
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def chat_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_greedy_chat_and_text_completions_equal_the_local_model(
    api: openai.OpenAI, local: Any, tokenizer: PreTrainedTokenizerBase
) -> None:
    assert [model.id for model in api.models.list().data] == [DEFAULT_MODEL]
    prompt = chat_ids(tokenizer, QUESTION)
    expected, generated = local_greedy(local, tokenizer, prompt, 24)
    reply = api.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": QUESTION}],
                                        max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == expected and "Paris" in expected
    assert reply.choices[0].finish_reason == ("length" if generated == 24 else "stop")
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), generated)

    text_prompt = "The three primary colors are"
    ids = list(tokenizer(text_prompt)["input_ids"])
    expected_text, _ = local_greedy(local, tokenizer, ids, 12)
    completion = api.completions.create(model=DEFAULT_MODEL, prompt=text_prompt, max_tokens=12, temperature=0)
    assert completion.choices[0].text == expected_text
    assert completion.usage is not None and completion.usage.prompt_tokens == len(ids)


def test_a_stream_sends_the_same_text_in_openais_chunks_then_usage_and_done(
    api: openai.OpenAI, api_url: str, local: Any, tokenizer: PreTrainedTokenizerBase
) -> None:
    expected, generated = local_greedy(local, tokenizer, chat_ids(tokenizer, QUESTION), 24)
    chunks = list(api.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": QUESTION}], max_completion_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == expected
    assert len(chunks) > 3  # token by token, not one piece
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] in {"stop", "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == generated
    with httpx.stream("POST", f"{api_url}/v1/completions", timeout=WAIT_S,
                      json={"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": 5, "stream": True,
                            "temperature": 0}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(line.removeprefix("data: "))["object"] == "text_completion" for line in lines[:-1])


def test_stop_sequences_end_the_text_before_them_and_seeds_repeat_samples(api: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    reply = api.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=24, temperature=0,
                                        stop=["Paris"])
    assert reply.choices[0].finish_reason == "stop"
    assert "Paris" not in (reply.choices[0].message.content or "")
    samples = [api.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=16, temperature=1.2,
                                           top_p=0.9, seed=seed).choices[0].message.content for seed in (7, 7)]
    assert samples[0] == samples[1] and samples[0]


def test_concurrent_requests_run_as_concurrent_sessions_that_the_servers_batch(
    api: openai.OpenAI, swarm: SwarmProcesses, local: Any, tokenizer: PreTrainedTokenizerBase
) -> None:
    questions = ["Hi!", "Name a fruit.", "What is 2+2?", "Say hello in French."]
    expected = [local_greedy(local, tokenizer, chat_ids(tokenizer, question), 16)[0] for question in questions]
    client = SwarmClient(resolve_model(DEFAULT_MODEL).model_id, 30, swarm.initial_peers, ClientConfig())
    try:
        before = sum(multi_step_batches(reply) for reply in infos(client).values())
        answers: dict[int, str] = {}

        def ask(index: int) -> None:
            answers[index] = api.chat.completions.create(
                model=DEFAULT_MODEL, messages=[{"role": "user", "content": questions[index]}], max_tokens=16,
                temperature=0).choices[0].message.content or ""

        threads = [threading.Thread(target=ask, args=(index,)) for index in range(len(questions))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=WAIT_S)
        assert [answers.get(index) for index in range(len(questions))] == expected
        after = sum(multi_step_batches(reply) for reply in infos(client).values())
        assert after > before  # steps of different requests computed in one batch
    finally:
        client.shutdown()


def test_the_api_and_the_servers_serve_prometheus_metrics(api_url: str, swarm: SwarmProcesses) -> None:
    """After the requests above: the API counts them by route and status, with tokens and time to first token;
    each server its batches, steps, tokens, pages by kind and pushes along the chain."""
    api = scrape(f"{api_url}/metrics")
    assert value(api, "chainswarm_api_requests_total", route="/v1/chat/completions", status="200") >= 8
    assert value(api, "chainswarm_api_requests_total", route="/v1/models", status="200") >= 1
    assert value(api, "chainswarm_api_tokens_generated_total") >= 50
    assert value(api, "chainswarm_api_time_to_first_token_seconds_count") >= 8
    assert value(api, "chainswarm_api_generations") == 0
    assert value(api, "chainswarm_api_failovers_total") == 0
    head, tail = (scrape(metrics_url(swarm, proc)) for proc in swarm.procs if proc.name.startswith("server-"))
    for server in (head, tail):
        assert value(server, "chainswarm_server_batch_size_count") > 0
        assert value(server, "chainswarm_server_batch_size_bucket", le="+Inf") == value(
            server, "chainswarm_server_batch_size_count")
        assert value(server, "chainswarm_server_step_seconds_count", kind="decode") > 0
        assert value(server, "chainswarm_server_tokens_computed_total") >= 100
        assert value(server, "chainswarm_server_sessions") == 0
        assert value(server, "chainswarm_server_pages", kind="kv") == 0
        assert value(server, "chainswarm_server_pages", kind="params") > 0
        assert value(server, "chainswarm_server_blocks") == 15
    assert value(head, "chainswarm_server_pushes_total", direction="sent") > 0  # decode steps go on to the tail
    assert value(tail, "chainswarm_server_pushes_total", direction="received") > 0


def test_a_client_that_leaves_mid_stream_ends_its_session_and_the_pages_go_back(
    api_url: str, swarm: SwarmProcesses
) -> None:
    client = SwarmClient(resolve_model(DEFAULT_MODEL).model_id, 30, swarm.initial_peers, ClientConfig())
    try:
        with httpx.stream("POST", f"{api_url}/v1/chat/completions", timeout=WAIT_S, json={
                "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 1500, "stream": True}) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]  # a few chunks, then hang up
        assert any(line.startswith("data: {") for line in received)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            records = [reply["record"] for reply in infos(client).values()]
            if all(record["session_count"] == 0 and record["pages_kv"] == 0 for record in records):
                break
            time.sleep(0.5)
        assert all(record["session_count"] == 0 and record["pages_kv"] == 0 for record in records), records
    finally:
        client.shutdown()


def test_errors_are_openai_error_objects_with_their_status(api: openai.OpenAI, api_url: str) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        api.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert not_found.value.code == "model_not_found"
    for bad, param in (({"temperature": 5}, "temperature"), ({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens"),
                       ({"max_tokens": 10**6}, "max_tokens")):
        with pytest.raises(openai.BadRequestError) as bad_request:
            api.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hi"}], **bad)
        assert bad_request.value.body is not None and bad_request.value.body["param"] == param  # type: ignore[index]
    response = httpx.post(f"{api_url}/v1/chat/completions", json={"model": DEFAULT_MODEL}, timeout=WAIT_S)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_a_request_past_its_timeout_gets_504(swarm: SwarmProcesses) -> None:
    _proc, hurried = swarm.start_api(DEFAULT_MODEL, "--timeout", "1", name="api-hurried")
    response = httpx.post(f"{hurried}/v1/completions", timeout=WAIT_S, json={
        "model": DEFAULT_MODEL, "prompt": "Count to a thousand:", "max_tokens": 1000, "temperature": 0})
    assert response.status_code == 504 and response.json()["error"]["type"] == "timeout"


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_api_with_its_swarm_client_and_leaves_no_temporary_directory(swarm: SwarmProcesses) -> None:
    """uvicorn drains on SIGTERM, then raises it again: with the default handler back, that ended the API before its
    engine shut down (its DHT process and p2p daemon left to the group's SIGKILL) and before multiprocessing removed
    its temporary directory. Now it exits 0, and takes its processes and that directory with it."""
    proc, url = swarm.start_api(DEFAULT_MODEL, name="api-stopped")
    assert httpx.get(f"{url}/v1/models", timeout=WAIT_S).status_code == 200
    pid = proc.popen.pid
    # multiprocessing's resource sharer listens there: hivemind's futures to the DHT's process started it
    private = {path.parent for path in bound_socket_files([pid])[pid] if path.parent.name.startswith("pymp-")}
    assert private
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=WAIT_S) == 0
    deadline = time.monotonic() + 10
    while group_alive(pid) and time.monotonic() < deadline:  # the DHT's process and p2pd, if they outlived it
        time.sleep(0.1)
    assert not group_alive(pid)
    assert not any(directory.exists() for directory in private)
    assert "Stopping on SIGTERM" in proc.output()


def test_the_live_page_shows_every_server_then_a_gap_in_red_and_the_api_answers_503(
    swarm: SwarmProcesses, api: openai.OpenAI, api_url: str, tmp_path: Path
) -> None:
    """In Debian's Chromium: the page lists both servers over their blocks, loads without console errors, and turns
    blocks 15-29 red once their only server is killed; requests then get 503 with Retry-After."""
    servers = {proc.name: proc.peer_id for proc in swarm.procs if proc.name.startswith("server-")}
    state = httpx.get(f"{api_url}/api/v1/swarm", timeout=WAIT_S).json()
    assert state["num_blocks"] == 30 and state["coverage"] == [1] * 30
    assert {server["peer_id"]: server["blocks"] for server in state["servers"]} == {
        servers["server-0-15-1"]: [0, 15], servers["server-15-30-2"]: [15, 30]}

    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 700})
            page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.goto(api_url)
            for peer_id in servers.values():
                page.wait_for_selector(f'[data-peer="{peer_id}"]', timeout=WAIT_S * 1000)
            assert page.locator(".block.gap").count() == 0
            tail = servers["server-15-30-2"]
            assert page.locator(f'[data-peer="{tail}"]').inner_text().startswith(f"…{tail[-8:]} [15:30]")

            swarm.kill(next(proc for proc in swarm.procs if proc.name == "server-15-30-2"))
            page.wait_for_function("document.querySelectorAll('.block.gap').length === 15", timeout=WAIT_S * 1000)
            gaps = [int(block) for block in page.locator(".block.gap").evaluate_all(
                "nodes => nodes.map(node => node.dataset.block)")]
            assert gaps == list(range(15, 30))
            assert page.locator(".block.gap").first.evaluate("node => getComputedStyle(node).backgroundColor") == \
                "rgb(211, 60, 60)"
            page.screenshot(path=str(tmp_path / "swarm-page.png"), full_page=True)
        finally:
            browser.close()
    assert problems == []
    assert (tmp_path / "swarm-page.png").stat().st_size > 0

    with pytest.raises(openai.APIStatusError) as unavailable:
        api.completions.create(model=DEFAULT_MODEL, prompt="Hello", max_tokens=2)
    assert unavailable.value.status_code == 503 and unavailable.value.response.headers["retry-after"]
