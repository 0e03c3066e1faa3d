"""The embedded default model: SmolLM2-135M-Instruct through 3 servers generates what it generates locally."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from client import DistributedModelForCausalLM
from swarm.local_swarm import SwarmProcesses, threads_per_server
from swarm.model import DEFAULT_MODEL, resolve_model
from tests.test_swarm_generate import start_swarm

pytestmark = pytest.mark.slow


def test_smollm2_chat_through_three_servers_matches_local_generate(
    swarm_factory: SwarmProcesses, capsys: pytest.CaptureFixture[str]
) -> None:
    source = resolve_model(DEFAULT_MODEL)  # converts the bundled GGUF once into the cache
    swarm_factory.torch_threads = threads_per_server(3)  # as the demo starts them
    start_swarm(swarm_factory, source.path, ["0:10", "10:20", "20:30"])
    for server in (proc for proc in swarm_factory.procs if proc.name != "dht"):
        assert f"on {threads_per_server(3)} torch thread(s)" in server.output(), server.output()[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    local = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    expected = local.generate(input_ids, max_new_tokens=24, do_sample=False)
    remote = DistributedModelForCausalLM.from_pretrained(DEFAULT_MODEL, initial_peers=swarm_factory.initial_peers)
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
