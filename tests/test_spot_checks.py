"""Spot-checks of servers' outputs (`ClientConfig.verify_fraction`): a server whose blocks return wrong hidden
states (this test corrupts them in its own code) is caught by a second server's recomputation and the verdict of a
chain of two others, banned, and its span replayed elsewhere; the generation ends with the local model's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.errors import WrongOutput
from swarm.local_swarm import REPO, SwarmProcesses
from tests.test_migration import local_and_remote
from tests.test_swarm_generate import prompt

pytestmark = [pytest.mark.slow, pytest.mark.own_swarm]
CORRUPTING = ["env", f"PYTHONPATH={Path(__file__).parent / 'corrupting'}:{REPO}"]


def test_a_corrupting_server_is_caught_banned_and_replaced_and_the_tokens_stay_exact(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    swarm_factory.start_dht()
    liar = swarm_factory.start_server(tiny_llama, "0:4", name="liar", launcher=CORRUPTING)
    tail = swarm_factory.start_server(tiny_llama, "4:8")
    local, remote = local_and_remote(swarm_factory, tiny_llama, verify_fraction=1.0, verify_seed=0)
    try:
        input_ids = prompt(8, 10)
        expected = local.generate(input_ids, max_new_tokens=6, do_sample=False)
        with remote.inference_session(max_length=32) as session:
            assert [span.peer_id for span in session.route] == [liar.peer_id, tail.peer_id]  # the only chain
            # a server of all the liar's blocks, and two that cover them as a chain: one checks, the other decides
            honest = [swarm_factory.start_server(tiny_llama, blocks, wait=False) for blocks in ("0:4", "0:2", "2:4")]
            for server in honest:
                swarm_factory.wait_ready(server)
            actual = remote.generate(input_ids, session=session, max_new_tokens=6, do_sample=False)
            assert session.route[0].peer_id in {server.peer_id for server in honest}
            checks = session.checks
            assert checks is not None and checks.caught == 1 and checks.disagreed == 1
            assert checks.checked >= 6  # the first span at every step (the liar's once, then honest servers')
            assert checks.unchecked >= 6  # span 4:8 has no other host to check it
        assert actual.tolist() == expected.tolist()
        assert liar.peer_id in remote.swarm.banned()
    finally:
        remote.shutdown()


def test_two_servers_that_disagree_with_no_third_fail_the_step_with_a_typed_error(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    """The swarm of the test above, without the two honest servers of blocks 0:4 but one: nobody can decide."""
    swarm_factory.start_dht()
    liar = swarm_factory.start_server(tiny_llama, "0:8", name="liar-alone", launcher=CORRUPTING)
    _local, remote = local_and_remote(swarm_factory, tiny_llama, verify_fraction=1.0, verify_seed=0)
    try:
        with remote.inference_session(max_length=32) as session:
            assert [span.peer_id for span in session.route] == [liar.peer_id]
            swarm_factory.start_server(tiny_llama, "0:8")
            with pytest.raises(WrongOutput, match="no third server"):
                remote.generate(prompt(9, 6), session=session, max_new_tokens=2, do_sample=False)
    finally:
        remote.shutdown()
