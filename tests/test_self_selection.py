"""Servers without --blocks and without an orchestrator choose their blocks as Petals' servers do."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import ClientConfig, DistributedModelForCausalLM
from swarm.local_swarm import SwarmProcesses
from tests.test_swarm_generate import prompt

pytestmark = pytest.mark.slow


def test_servers_started_one_by_one_choose_spans_that_cover_every_block(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    swarm_factory.start_dht()
    ranges = []
    for _ in range(3):  # 3 x 3 blocks for 8: each takes the least served window when it joins
        server = swarm_factory.start_server(tiny_llama, None, "--num-blocks", "3", "--rebalance-period", "1")
        line = swarm_factory.wait_for_line(server, "ready peer_id=")
        start, end = (int(part) for part in line.split("blocks=")[1].split(":"))
        ranges.append((start, end))
    assert ranges == [(0, 3), (3, 6), (5, 8)]
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    remote = DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama), initial_peers=swarm_factory.initial_peers, client_config=ClientConfig(orchestrator=None)
    )
    try:
        input_ids = prompt(5)
        expected = local.generate(input_ids, max_new_tokens=8, do_sample=False)
        assert remote.generate(input_ids, max_new_tokens=8, do_sample=False).tolist() == expected.tolist()
    finally:
        remote.shutdown()
    # a balanced swarm stays put: the hysteresis keeps servers from chasing each other
    time.sleep(2.5)  # two more rebalance rounds
    moves = [line for proc in swarm_factory.procs for line in proc.output().splitlines() if line.startswith("blocks ")]
    assert not moves
