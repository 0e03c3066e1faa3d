"""KV packing led by the orchestrator (`swarm-orchestrator --kv-packing`): the sessions its followers run are packed
onto fewer servers, a move runs only where JFFC's plan has a free slot, the moved session's lease follows it, and
tokens stay those of the local model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import ClientConfig, DistributedModelForCausalLM
from swarm.local_swarm import SwarmProcesses
from tests.test_migration import infos, prompt
from tests.test_orchestrator_live import orchestrator_state, wait_for

pytestmark = pytest.mark.slow
TIMEOUT_S = 30.0
# 16 KiB pages: a tiny-Llama block takes 10 pages, and a session of up to 62 tokens one page per block; 1920 KiB leave
# 40 KV pages next to the 8 blocks: the packing's C is 32 (8 kept for growth), 4 such sessions. With jobs planned at
# 100 tokens (2 pages a block), JFFC's chain (one server each: "jffc-only") takes 2 sessions.
SERVER_ARGS = ("--page-size", "16KiB", "--memory", "1920KiB")
ORCHESTRATOR_ARGS = ("--variant", "jffc-only", "--cache-tokens", "100", "--kv-packing", "bf", "--packing-epoch", "0.5",
                     "--refresh-period", "0.5", "--lease-ttl", "10")


def orchestrated_pair(swarm_factory: SwarmProcesses, model: Path, orchestrator_args: tuple[str, ...],
                      server_args: tuple[str, ...]) -> tuple[AutoModelForCausalLM, DistributedModelForCausalLM]:
    """Starts the DHT, an orchestrator and two servers that follow it; gives the local model and a client that asks
    the orchestrator for chains."""
    swarm_factory.start_dht()
    orchestrator = swarm_factory.start_orchestrator(model, *orchestrator_args)
    followers = [swarm_factory.start_server(model, None, "--orchestrator", orchestrator.peer_id, *server_args,
                                            wait=False) for _ in range(2)]
    for follower in followers:  # the two start side by side
        swarm_factory.wait_started(follower)
    local = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    remote = DistributedModelForCausalLM.from_pretrained(
        str(model), initial_peers=swarm_factory.initial_peers,
        client_config=ClientConfig(orchestrator="auto", request_timeout_s=TIMEOUT_S),
    )
    return local, remote


def test_the_orchestrator_packs_its_followers_sessions_and_their_leases_follow_the_moves(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    local, remote = orchestrated_pair(swarm_factory, tiny_llama, ORCHESTRATOR_ARGS, SERVER_ARGS)
    try:
        wait_for(lambda: [c["capacity"] for c in orchestrator_state(remote)["chains"]] == [2, 2], "two chains of 2")
        client = remote.swarm
        baseline = {peer: info["record"]["pages_free"] for peer, info in infos(client).items()}
        prompts = [prompt(31 + index, length=12) for index in range(3)]
        sessions = [remote.inference_session(max_length=48, prompt_tokens=12) for _ in range(3)]
        try:
            # JFFC fills the fastest chain's 2 slots, the third session takes the other chain
            outputs = [remote.generate(p, session=s, max_new_tokens=3, do_sample=False)
                       for p, s in zip(prompts, sessions, strict=True)]
            assert sorted(chain["in_use"] for chain in orchestrator_state(remote)["chains"]) == [1, 2]
            servers = {session.route[0].peer_id for session in sessions}
            assert len(servers) == 2
            sessions[0].close()  # a slot frees: best fit packs the other two onto one server, if the plan has room

            def packed() -> bool:
                state = orchestrator_state(remote)
                moves = sum(loop["moves"]["kv"] + loop["moves"]["replay"] for loop in state["packing"].values())
                return sorted(c["in_use"] for c in state["chains"]) == [0, 2] and moves >= 1

            wait_for(packed, "a move that puts both sessions' leases on one chain")
            # they go on with the local model's tokens, each on the one server both now use
            for index in (1, 2):
                turn = prompt(41 + index, length=3)
                continued = remote.generate(turn, session=sessions[index], max_new_tokens=3, do_sample=False)
                expected = local.generate(torch.cat([outputs[index], turn], dim=1), max_new_tokens=3, do_sample=False)
                assert continued.tolist() == expected[:, outputs[index].shape[1]:].tolist()
                assert sessions[index].failovers == 0
            # (a session moved by replay is on its new server from its client's next step on)
            assert sessions[1].route[0].peer_id == sessions[2].route[0].peer_id
            assert sorted(info["record"]["session_count"] for info in infos(client).values()) == [0, 2]
        finally:
            for session in sessions[1:]:
                session.close()
        wait_for(lambda: orchestrator_state(remote)["leases"] == 0, "every lease released")
        wait_for(lambda: {peer: info["record"]["pages_free"] for peer, info in infos(client).items()} == baseline,
                 "both pools back at their baselines")
    finally:
        remote.shutdown()
