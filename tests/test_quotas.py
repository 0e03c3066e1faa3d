"""Per-client quotas on a live server: a client that holds as many sessions as one client may is refused with the
typed `QuotaExceeded` (a kind of `ServerBusy`: routed around like a full server), and another client generates as
before, with the local model's tokens."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from client import ClientConfig, DistributedModelForCausalLM
from swarm.errors import QuotaExceeded, ServerBusy, SwarmError
from swarm.local_swarm import SwarmProcesses
from tests.test_migration import local_and_remote
from tests.test_swarm_generate import prompt

pytestmark = pytest.mark.slow


def test_a_client_over_its_session_quota_gets_the_typed_refusal_and_another_client_is_unaffected(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    swarm_factory.start_dht()
    server = swarm_factory.start_server(tiny_llama, "0:8", "--client-max-sessions", "2")
    local, greedy = local_and_remote(swarm_factory, tiny_llama)
    other = DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama), initial_peers=swarm_factory.initial_peers,
        client_config=ClientConfig(request_timeout_s=30.0, busy_wait_s=1.0))
    try:
        client = greedy.swarm
        connection = client.run(client.connect(client.run(client.servers())[server.peer_id]))
        request = {"blocks": [0, 8], "max_length": 64}
        try:  # sessions live as long as the stream that opened them
            for _ in range(2):
                client.run(connection.call("open", request, timeout=30.0))
            with pytest.raises(SwarmError) as refused:
                client.run(connection.call("open", request, timeout=30.0))
            assert isinstance(refused.value, QuotaExceeded) and isinstance(refused.value, ServerBusy)
            assert "2 sessions" in refused.value.message

            input_ids = prompt(7, 12)
            expected = local.generate(input_ids, max_new_tokens=8, do_sample=False)
            assert other.generate(input_ids, max_new_tokens=8, do_sample=False).tolist() == expected.tolist()
        finally:
            client.run(connection.close())  # its sessions close: room for the first client again
        assert greedy.generate(input_ids, max_new_tokens=8, do_sample=False).tolist() == expected.tolist()
    finally:
        other.shutdown()
        greedy.shutdown()


def test_a_new_session_routes_on_a_recent_lookup_and_a_busy_one_looks_the_dht_up_once_a_round(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    swarm_factory.start_dht()
    server = swarm_factory.start_server(tiny_llama, "0:8", "--client-max-sessions", "1")
    local, remote = local_and_remote(swarm_factory, tiny_llama, busy_wait_s=60.0, records_max_age_s=60.0)
    try:
        client = remote.swarm
        assert server.peer_id in client.run(client.servers())
        lookups = 0
        servers = client.servers

        async def counted_servers():  # type: ignore[no-untyped-def]
            nonlocal lookups
            lookups += 1
            return await servers()

        client.servers = counted_servers  # type: ignore[method-assign]
        first = remote.inference_session(max_length=32)  # the quota's one session
        assert lookups == 0  # it routed on the lookup above, less than records_max_age_s ago
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(remote.inference_session, max_length=32)
            deadline = time.monotonic() + 30.0
            while lookups < 3 and time.monotonic() < deadline:  # a third fresh round: it has backed off twice
                time.sleep(0.05)
            assert lookups >= 3 and not waiting.done()
            first.close()
            session = waiting.result(timeout=30.0)
        attempts = session.open_attempts
        kinds = [attempt.kind for attempt in attempts]
        # the recent records gave no chain (the server refused): a round on fresh ones at once, then the back-offs
        assert kinds[:7] == ["route", "open", "route", "route", "open", "route", "backoff"]
        assert kinds[-1] == "open" and attempts[-1].outcome == "ok" and attempts[-1].peer_id == server.peer_id
        refused = [attempt for attempt in attempts if attempt.kind == "open" and attempt.outcome != "ok"]
        assert {attempt.outcome for attempt in refused} == {"QuotaExceeded"}
        backoffs = [float(attempt.outcome) for attempt in attempts if attempt.kind == "backoff"]
        assert len(backoffs) >= 2 and backoffs == [0.5 * 2**i for i in range(len(backoffs))]  # doubling from 0.5 s
        assert lookups == len(backoffs) + 1  # one DHT lookup a round, however many servers refuse in it
        with session:
            input_ids = prompt(7, 12)
            expected = local.generate(input_ids, max_new_tokens=8, do_sample=False)
            generated = remote.generate(input_ids, session=session, max_new_tokens=8, do_sample=False)
            assert generated.tolist() == expected.tolist()
    finally:
        remote.shutdown()
