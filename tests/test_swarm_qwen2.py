"""A swarm of tiny Qwen2 servers (q/k/v biases, tied embeddings) matches the local HF model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import DistributedModelForCausalLM
from swarm.local_swarm import SwarmProcesses
from tests.test_swarm_generate import prompt, start_swarm

pytestmark = pytest.mark.slow


def test_qwen2_logits_and_greedy_tokens_match_local(swarm_factory: SwarmProcesses, tiny_qwen2: Path) -> None:
    start_swarm(swarm_factory, tiny_qwen2, ["0:3", "3:6", "6:8"])
    local = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    remote = DistributedModelForCausalLM.from_pretrained(str(tiny_qwen2), initial_peers=swarm_factory.initial_peers)
    try:
        input_ids = prompt(0, 10)
        with torch.no_grad():
            torch.testing.assert_close(remote(input_ids).logits, local(input_ids).logits, rtol=1e-5, atol=1e-5)
        expected = local.generate(input_ids, max_new_tokens=12, do_sample=False)
        assert remote.generate(input_ids, max_new_tokens=12, do_sample=False).tolist() == expected.tolist()
    finally:
        remote.shutdown()
