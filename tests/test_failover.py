"""Failover: kill -9 servers mid-generation; the client replays their inputs elsewhere and tokens stay identical."""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from client import ClientConfig, DistributedModelForCausalLM
from swarm.local_swarm import Proc, SwarmProcesses
from tests.test_swarm_generate import prompt

pytestmark = pytest.mark.slow


class ActAfterTokens(BaseStreamer):
    """Runs `actions[n]` right after the n-th generated token was streamed (the prompt is the first put)."""

    def __init__(self, actions: dict[int, Callable[[], None]]) -> None:
        self.actions, self.puts = actions, -1

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts in self.actions:
            self.actions[self.puts]()

    def end(self) -> None:
        pass


def identities() -> set[str]:
    """Gives the identity folders in the system's temp dir (`swarm.signing.open_dht` makes one for a process started
    without an identity, and removes it at exit: a process killed with SIGKILL leaves it behind)."""
    return {entry.name for entry in Path(tempfile.gettempdir()).glob("chainswarm-identity-*")}


def test_kill_9_mid_generation_replays_history_and_tokens_match(swarm_factory: SwarmProcesses, tiny_llama: Path):
    temp_identities = identities()
    swarm_factory.start_dht()
    servers = [swarm_factory.start_server(tiny_llama, blocks, wait=False) for blocks in ("0:4", "0:4", "4:8", "4:8")]
    for server in servers:
        swarm_factory.wait_ready(server)
    by_peer: dict[str, Proc] = {server.peer_id: server for server in servers}
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    remote = DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama), initial_peers=swarm_factory.initial_peers, client_config=ClientConfig(request_timeout_s=20)
    )
    killed: list[str] = []
    try:
        input_ids = prompt(30, 11)
        expected = local.generate(input_ids, max_new_tokens=20, do_sample=False)
        with remote.inference_session(max_length=64) as session:

            def kill_server_of(span_index: int) -> Callable[[], None]:
                def kill() -> None:
                    peer_id = session.route[span_index].peer_id
                    killed.append(peer_id)
                    swarm_factory.kill(by_peer[peer_id], signal.SIGKILL)
                    by_peer[peer_id].popen.wait(timeout=30)

                return kill

            streamer = ActAfterTokens({3: kill_server_of(1), 9: kill_server_of(0)})
            actual = remote.generate(input_ids, session=session, max_new_tokens=20, do_sample=False, streamer=streamer)
            assert session.failovers == 2
            assert not {span.peer_id for span in session.route} & set(killed)
        assert actual.tolist() == expected.tolist()
        assert len(killed) == 2
        # the killed servers' keys are in the swarm's workdir, which the harness removes, not in the temp dir
        assert identities() <= temp_identities
        for peer_id in killed:
            args = by_peer[peer_id].popen.args
            key = Path(args[args.index("--identity") + 1])
            assert key.parent == swarm_factory.workdir and key.is_file()
    finally:
        remote.shutdown()
