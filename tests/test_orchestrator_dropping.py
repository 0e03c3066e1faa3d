"""KunServe led by the orchestrator (`swarm-orchestrator --kv-dropping`): a burst that waits in JFFC's queue makes
the orchestrator drop half of each follower's blocks, JFFC dispatches over GCA's chains through the pair, every
session ends with the local model's tokens, and once the burst is over the followers restore and the chains are
whole servers again."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from swarm.local_swarm import SwarmProcesses
from tests.test_dropping import POOL, SMALL_SESSIONS, Generation, generate_watching
from tests.test_migration import infos
from tests.test_orchestrator_live import orchestrator_state, wait_for
from tests.test_orchestrator_packing import orchestrated_pair
from tests.test_swarm_generate import prompt

pytestmark = pytest.mark.slow
TIMEOUT_S = 30.0
# jffc-only: the whole model on each follower; a job planned at 40 tokens takes one page per block, so each chain of
# one server has 2 slots (20 KV pages); a chain through both halves of a dropped pair has more (60 pages a server).
ORCHESTRATOR_ARGS = ("--variant", "jffc-only", "--cache-tokens", "40", "--kv-dropping", "--drop-period", "0.25",
                     "--restore-after", "2", "--restore-calm", "2", "--refresh-period", "0.5", "--lease-ttl", "10")


def test_a_burst_in_the_orchestrators_queue_makes_its_followers_drop_and_jffc_dispatch_through_the_pair(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    local, remote = orchestrated_pair(swarm_factory, tiny_llama, ORCHESTRATOR_ARGS,
                                      (*POOL, *SMALL_SESSIONS, "--kv-exchange", "blocking"))
    try:
        wait_for(lambda: [c["capacity"] for c in orchestrator_state(remote)["chains"]] == [2, 2], "two chains of 2")
        prompts = [prompt(seed, 16) for seed in range(8)]
        # 40 new tokens (of max_length 64, still one KV page per block): the queue lasts until a drop looks at it
        expected = [local.generate(ids, max_new_tokens=40, do_sample=False).tolist() for ids in prompts]
        longest_chain = [0]

        def look() -> None:
            chains = orchestrator_state(remote)["chains"]
            longest_chain[0] = max([longest_chain[0], *(len(chain["servers"]) for chain in chains)])

        # the first four fill both chains and hold KV before the next four wait in the queue, so that the drop comes
        # while sessions run (it may not come before they opened: then it would have no victims whose KV to hold for)
        first_tokens = threading.Semaphore(0)
        running = Generation(remote, prompts[:4], new_tokens=40, after_first_token=first_tokens.release)
        assert all(first_tokens.acquire(timeout=TIMEOUT_S) for _ in range(4)), "the first four never got a token"
        queued = generate_watching(remote, prompts[4:], new_tokens=40, look=look)
        running.join()
        assert running.errors == queued.errors == [] and running.outputs + queued.outputs == expected
        assert longest_chain[0] == 2, "JFFC never dispatched through the dropped pair"

        # the burst is over: the orchestrator restores both, and its chains are whole servers again
        wait_for(lambda: [c["capacity"] for c in orchestrator_state(remote)["chains"]] == [2, 2],
                 "two chains of one whole server each", timeout_s=TIMEOUT_S)
        state = orchestrator_state(remote)
        (loop,) = state["dropping"].values()
        # a restore counts when a member had blocks to load back (not when the loop asks a member that has none)
        assert loop["drops"] >= 1 and loop["restores"] == loop["drops"], loop
        for peer, info in infos(remote.swarm).items():
            assert (info["record"]["block_start"], info["record"]["block_end"]) == (0, 8), peer
            assert info["dropping"]["drops"] >= 1 and info["dropping"]["restorable"] is None
            assert info["dropping"]["exchange"]["replayed"] == 0, info["dropping"]["exchange"]
        assert len(infos(remote.swarm)) == 2
        # the drop came while they ran sessions: a member held pages back for its mate's victims' KV
        assert any("Holding" in proc.output() for proc in swarm_factory.procs if proc.name.startswith("server")), (
            [proc.output()[-3000:] for proc in swarm_factory.procs if proc.name.startswith("server")])
    finally:
        remote.shutdown()
