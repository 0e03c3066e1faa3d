"""The live orchestrator's pure parts: records -> policy model, few moves in a safe order, Petals-style self-chosen
blocks with hysteresis, the windowed load estimate, JFFC leases and the queue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from orchestrator.block_selection import HostedSpan, better_start, blocks_that_fit, choose_start
from orchestrator.dispatch import JFFC
from orchestrator.live_model import JobSizes, replay_prefill_ms_per_token, swarm_model
from orchestrator.observed_load import ObservedLoad
from orchestrator.replan import blocks_moved, match_roles, move_order, placement_ranges
from orchestrator.service.leases import LeaseNotFound, LeaseTable, LiveChain, Span
from orchestrator.service.orchestrator import LivePlan, Orchestrator, OrchestratorConfig
from orchestrator.swarm_model import Chain, Placement
from orchestrator.tuning import plan_for_capacity, tune_capacity
from swarm.records import LONG_PREFILL_HISTORY_TOKENS, BatchTiming, ServerRecord

MIB = 1 << 20


def record(peer_id: str, *, pages_total: int = 100, block_bytes: int = 3 * MIB + 1, decode_ms: float = 2.0,
           start: int = 0, end: int = 0) -> ServerRecord:
    return ServerRecord(
        peer_id=peer_id, model_id="m", block_start=start, block_end=end, state="joining" if end == start else "online",
        pages_total=pages_total, pages_params=0, pages_kv=0, pages_free=pages_total, sessions_fit=0, page_bytes=MIB,
        kv_bytes_per_token=4096, block_bytes=block_bytes, block_compute_ms=decode_ms,
        block_decode_ms=[BatchTiming(batch=1, ms=decode_ms), BatchTiming(batch=8, ms=4 * decode_ms)],
        network_mbps=None, session_count=0, max_length=2048, dtype="float32", quant="none", version="test",
        public_name=None, addrs=[],
    )


def test_records_become_the_policy_model_in_whole_pages_and_per_job_times() -> None:
    jobs = JobSizes(prompt_tokens=100, output_tokens=28)
    model = swarm_model({"b": record("b", pages_total=40), "a": record("a", decode_ms=1.0)}, {"a": 5.0}, jobs, 32)
    assert [server.name for server in model.servers] == ["a", "b"]
    a, b = model.servers
    assert model.model.blocks == 32
    assert model.model.block_gb == pytest.approx(4 * MIB / 1e9)  # 3 MiB + 1 byte takes 4 pages
    assert model.model.cache_gb == pytest.approx(1 * MIB / 1e9)  # 128 tokens x 4096 B = 512 KiB: one page
    assert a.memory_gb == pytest.approx(100 * MIB / 1e9) and b.memory_gb == pytest.approx(40 * MIB / 1e9)
    # tau_p = prompt x (batch-8 step / 8) + output x (batch-1 step); tau_c = (output + 1) x RTT
    assert a.tau_p_ms == pytest.approx(100 * 4.0 / 8 + 28 * 1.0)
    assert a.tau_c_ms == pytest.approx(29 * 5.0)
    assert b.tau_c_ms == pytest.approx(29 * 5.0)  # never measured: the largest RTT measured
    # a server that announces its measured prefill chunk's time per token: that, not the decode proxy
    measured = record("a", decode_ms=1.0).model_copy(update={"block_prefill_ms_per_token": 0.05})
    (a,) = swarm_model({"a": measured}, {"a": 5.0}, jobs, 32).servers
    assert a.tau_p_ms == pytest.approx(100 * 0.05 + 28 * 1.0)
    assert a.tau_p_prefill_ms == pytest.approx(100 * 0.05)  # the prompt's share, which prefills on a server share
    # a replay's prefill: the measured time grows with the history, so a prompt's mean is the time at its middle
    assert replay_prefill_ms_per_token(measured, 2000) == pytest.approx(0.05)  # no long-history measurement
    long = measured.model_copy(update={"block_prefill_ms_per_token_long": 0.05 + 0.1})
    assert replay_prefill_ms_per_token(long, 0) == pytest.approx(0.05)
    assert replay_prefill_ms_per_token(long, 2 * LONG_PREFILL_HISTORY_TOKENS) == pytest.approx(0.15)


def test_the_decode_growth_by_batch_size_becomes_tau_p_batch_unless_the_model_is_the_papers() -> None:
    jobs = JobSizes(prompt_tokens=100, output_tokens=28)
    (a,) = swarm_model({"a": record("a", decode_ms=1.0)}, {"a": 5.0}, jobs, 32).servers
    assert a.tau_p_batch_ms == pytest.approx(28 * (4.0 - 1.0) / (8 - 1))  # per output token, the step's slope
    (paper,) = swarm_model({"a": record("a", decode_ms=1.0)}, {"a": 5.0}, jobs, 32, batching=False).servers
    assert paper.tau_p_batch_ms == 0.0 and paper.tau_p_prefill_ms == 0.0 and paper.tau_p_ms == a.tau_p_ms
    alone = record("a").model_copy(update={"block_decode_ms": [BatchTiming(batch=1, ms=2.0)]})
    assert swarm_model({"a": alone}, {}, jobs, 32).servers[0].tau_p_batch_ms == 0.0  # one batch size: no slope


def test_roles_go_to_the_servers_of_a_kind_that_keep_most_blocks() -> None:
    target = placement_ranges(Placement({"a": (1, 4), "b": (5, 4), "c": (1, 8)}))
    assert target == {"a": (0, 4), "b": (4, 8), "c": (0, 8)}
    current = {"a": (4, 8), "b": (0, 4), "c": (0, 8)}
    kinds = {"a": "small", "b": "small", "c": "large"}
    matched = match_roles(target, current, lambda name, other: kinds[name] == kinds[other])
    assert matched == current and blocks_moved(current, matched) == 0
    assert blocks_moved(current, target) == 8  # handing out the roles as placed would move 8 blocks


def test_moves_go_in_an_order_that_keeps_every_block_served() -> None:
    # b must move from 4:8 to 0:4 and a from 0:4 to 4:8: whoever goes first uncovers half the model, unless c (now
    # 0:2) first grows to cover it; a safe order exists and is found.
    current = {"a": (0, 4), "b": (4, 8), "c": (0, 2)}
    target = {"a": (4, 8), "b": (0, 4), "c": (0, 8)}
    order = move_order(current, target, 8)
    assert order[0] == "c" and sorted(order) == ["a", "b", "c"]
    serving = dict(current)
    for name in order:  # while `name` moves it serves only what both ranges share
        old, new = serving[name], target[name]
        during = {**serving, name: (max(old[0], new[0]), min(old[1], new[1]))}
        assert all(any(s <= block < e for s, e in during.values()) for block in range(8)), name
        serving[name] = new


def test_self_chosen_blocks_fill_the_least_served_span_and_moves_need_a_clear_gain() -> None:
    spans = {"a": HostedSpan(0, 4, 1.0)}
    assert choose_start(spans, 8, 4) == 4
    spans["b"] = HostedSpan(4, 8, 1.0)
    assert better_start(spans, 8, "a") is None and better_start(spans, 8, "b") is None
    crowded = {"a": HostedSpan(0, 4, 1.0), "b": HostedSpan(0, 4, 1.0), "c": HostedSpan(4, 8, 1.0)}
    assert better_start(crowded, 8, "b") is None  # moving b would leave 0:4 as served as 4:8 is now: no gain
    lopsided = {"a": HostedSpan(0, 4, 1.0), "b": HostedSpan(0, 4, 1.0), "c": HostedSpan(0, 4, 1.0),
                "d": HostedSpan(4, 8, 1.0)}
    start = better_start(lopsided, 8, "c")
    assert start == 4
    moved = {**lopsided, "c": HostedSpan(4, 8, 1.0)}
    assert better_start(moved, 8, "c") is None and better_start(moved, 8, "a") is None  # no chasing back
    assert blocks_that_fit(100 * MIB, 4 * MIB, 1 * MIB, 32) == 20
    assert blocks_that_fit(10 * MIB, 40 * MIB, 0, 32) == 1


def test_the_arrival_rate_counts_a_sliding_window_and_jobs_are_means_of_ended_ones() -> None:
    load = ObservedLoad(0.2, JobSizes(128, 128), window_s=10.0, min_arrivals=3, started_s=0.0)
    load.arrive(1.0)
    assert load.rate_per_s(1.0) == 0.2  # the prior until 3 arrived
    load.arrive(2.0)
    load.arrive(3.0)
    assert load.rate_per_s(5.0) == pytest.approx(3 / 5)  # run for 5 s, less than a window
    assert load.rate_per_s(11.5) == pytest.approx(2 / 10)  # the first left the window
    assert load.rate_per_s(100.0) == pytest.approx(0.01)  # the floor
    for time_s in (20.0, 21.0, 22.0):
        load.end(time_s, prompt_tokens=10, output_tokens=30)
    assert load.jobs(22.0) == JobSizes(10, 30)
    assert load.jobs(40.0) == JobSizes(128, 128)  # all left the window: the prior again


def test_jffc_withdraws_a_queued_job_and_counts_carried_over_jobs() -> None:
    chains = [Chain(("a",), (8,), 1, 10.0), Chain(("b",), (8,), 2, 20.0)]
    jffc = JFFC(chains)
    assert [jffc.arrive(job) for job in "xyzw"] == [0, 1, 1, None]
    assert jffc.withdraw("w") and not jffc.withdraw("w") and jffc.queue_length == 0
    fresh = JFFC(chains)
    fresh.occupy(0)
    fresh.occupy(0)  # one more than its capacity: carried over from an older plan
    assert fresh.arrive("p") == 1 and fresh.arrive("q") == 1 and fresh.arrive("r") is None
    assert fresh.complete(0) is None  # still at its capacity: the queue waits for a chain below it
    assert fresh.complete(0) == "r"


def chain(*peers: str, capacity: int = 1, time_ms: float = 10.0) -> LiveChain:
    width = 8 // len(peers)
    return LiveChain(tuple(Span(peer, i * width, (i + 1) * width) for i, peer in enumerate(peers)), capacity, time_ms)


def test_leases_start_at_once_queue_when_full_and_pass_on_release_or_expiry() -> None:
    async def body() -> None:
        table = LeaseTable(lease_ttl_s=5.0)
        fast, slow = chain("a", "b", time_ms=10.0), chain("c", time_ms=30.0)
        table.install([fast, slow], 0.0)
        _, first = table.request(9, 0.0)
        _, second = table.request(9, 0.0)
        _, third = table.request(9, 0.0)
        gone_id, fourth = table.request(9, 0.0)
        assert (await first).chain == fast and (await second).chain == slow
        assert not third.done() and table.queued == 2
        table.withdraw(gone_id)  # its client went away while queued
        lease = table.release((await first).lease_id, 1.0)
        assert lease.prompt_tokens == 9 and (await third).chain == fast and not fourth.done()
        with pytest.raises(LeaseNotFound):
            table.release(lease.lease_id, 1.0)
        table.renew((await third).lease_id, 4.0)
        expired = table.expire(6.5)  # the second (renewed at 0) expired; the third was renewed at 4
        assert [e.lease_id for e in expired] == [(await second).lease_id]
        assert table.in_use(0) == 1 and table.in_use(1) == 0 and table.dispatched == 3
        table.pause()
        _, later = table.request(9, 7.0)
        assert not later.done()
        table.install([fast], 7.0)  # the lease on `fast` carries over: the new request waits for it
        assert table.in_use(0) == 1 and not later.done()
        table.release((await third).lease_id, 8.0)
        assert (await later).chain == fast

    asyncio.run(body())


def test_leases_rank_chains_by_their_service_time_at_the_batches_their_servers_run() -> None:
    async def body() -> None:
        table = LeaseTable(lease_ttl_s=5.0)
        fast, slow = chain("a", time_ms=10.0, capacity=4), chain("c", time_ms=30.0, capacity=4)
        table.install([fast, slow], 0.0, {"a": 1.0})  # each session on `a` adds 8 blocks x 1 ms
        leases = [await table.request(9, 0.0)[1] for _ in range(4)]
        assert [lease.chain for lease in leases] == [fast, fast, fast, slow]  # 10, 18, 26, then 34 > 30
        assert table.service_time_ms(0) == pytest.approx(34.0) and table.service_time_ms(1) == pytest.approx(30.0)
        table.release(leases[0].lease_id, 1.0)
        assert (await table.request(9, 1.0)[1]).chain == fast

    asyncio.run(body())


def test_chains_through_the_packings_standbys_get_new_sessions_last_and_a_new_plan_keeps_them_last() -> None:
    async def body() -> None:
        table = LeaseTable(lease_ttl_s=5.0)
        fast, slow = chain("a", time_ms=10.0), chain("c", time_ms=30.0)
        table.install([fast, slow], 0.0)
        table.set_standby({"a"})
        first = await table.request(9, 0.0)[1]
        assert first.chain == slow
        table.install([fast, slow], 1.0)  # a re-plan: `a` is still a standby
        second = await table.request(9, 1.0)[1]
        assert second.chain == fast  # the only free slot left: the standby takes it rather than queue the session
        table.release(first.lease_id, 2.0)
        table.release(second.lease_id, 2.0)
        table.set_standby(set())  # `a` takes sessions again: the fastest chain first
        assert (await table.request(9, 3.0)[1]).chain == fast

    asyncio.run(body())


def test_the_orchestrator_composes_with_the_simulators_functions_for_each_variant(tiny_llama: Path) -> None:

    records = {name: record(name, pages_total=pages) for name, pages in (("a", 120), ("b", 60), ("c", 60))}
    model = swarm_model(records, {"a": 5.0, "b": 8.0, "c": 8.0}, JobSizes(100, 28), 8)
    proposed = Orchestrator(OrchestratorConfig(model=str(tiny_llama), variant="proposed"))._compose(model, 0.5)
    expected = tune_capacity(model, 0.5 / 1000, 0.7, method="lower_bound")
    assert proposed is not None and (proposed.c, proposed.placement) == (expected.c, expected.placement)
    whole = Orchestrator(OrchestratorConfig(model=str(tiny_llama), variant="jffc-only"))._compose(model, 0.5)
    assert whole is not None and set(whole.placement.blocks.values()) == {(1, 8)}
    assert [chain.servers for chain in whole.chains] == [("a",), ("b",), ("c",)]


def test_past_every_stable_c_the_orchestrator_plans_for_the_most_throughput(tiny_llama: Path) -> None:
    records = {name: record(name, pages_total=pages) for name, pages in (("a", 120), ("b", 60))}
    model = swarm_model(records, {"a": 5.0, "b": 8.0}, JobSizes(100, 28), 8)
    with pytest.raises(ValueError):
        tune_capacity(model, 1e6 / 1000, 0.7, method="lower_bound")  # a million jobs/s: no c is stable
    plan = Orchestrator(OrchestratorConfig(model=str(tiny_llama), variant="proposed"))._compose(model, 1e6)
    assert plan is not None and plan.chains and not plan.stable
    others = [plan_for_capacity(model, c, 1e6 / 1000, 0.7) for c in (1, 2, 4, 8, 16)]
    assert plan.total_rate_per_ms >= max(other.total_rate_per_ms for other in others if other.chains)


def test_a_rate_driven_re_plan_waits_until_the_plan_has_run_a_whole_rate_window(tiny_llama: Path) -> None:
    """Arrivals measured within a window of a re-plan echo the re-plan itself (dispatch paused, closed-loop clients
    following the chains' speed): the rate may re-plan only once the plan has run `rate_window_s`; a follower that
    joins or leaves re-plans at once."""
    orchestrator = Orchestrator(OrchestratorConfig(model=str(tiny_llama), variant="proposed", rate_window_s=60.0))
    followers = {"a": record("a", start=0, end=4), "b": record("b", start=4, end=8)}
    orchestrator.plan = LivePlan(c=10**6, method="proposed", ranges={"a": (0, 4), "b": (4, 8)}, chains=(),
                                 lower_ms=0.0, upper_ms=0.0, rate_per_s=0.2, servers=frozenset(followers),
                                 installed_s=1000.0)  # no tuning gives this c: any rate-driven look re-plans

    def replans(rate_per_s: float, now_s: float, records: dict[str, ServerRecord] = followers) -> bool:
        return orchestrator._should_replan(records, rate_per_s, now_s, became_active=False)

    assert not replans(0.4, 1059.0)  # the rate doubled, 59 s after the plan: not yet
    assert replans(0.4, 1061.0)
    assert not replans(0.24, 1061.0)  # within the rate's hysteresis (25%)
    assert replans(0.2, 1001.0, {**followers, "c": record("c")})  # membership changes wait for nothing


def test_a_lease_follows_its_session_to_the_chain_a_move_gives_it_when_that_chain_has_room() -> None:
    async def body() -> None:
        table = LeaseTable(lease_ttl_s=5.0)
        a, b = chain("a", time_ms=10.0), chain("b", time_ms=20.0)  # capacity 1 each
        table.install([a, b], 0.0)
        on_a, on_b = (await table.request(1, 0.0)[1]), (await table.request(1, 0.0)[1])
        _, waiting = table.request(1, 0.0)
        assert (on_a.chain, on_b.chain) == (a, b) and not waiting.done()
        # a is full: b's session may not move there; a chain of no plan ("b" -> "z") is no place either
        assert not table.can_follow(on_b.lease_id, "b", "a") and not table.can_follow(on_b.lease_id, "b", "z")
        table.release(on_a.lease_id, 1.0)  # a's slot goes to the queue's head
        assert (await waiting).chain == a and not table.can_follow(on_b.lease_id, "b", "a")
        table.release((await waiting).lease_id, 2.0)
        assert table.can_follow(on_b.lease_id, "b", "a")
        _, queued = table.request(1, 2.5)
        assert (await queued).chain == a  # the queue is empty again: a new session takes a at once
        table.release((await queued).lease_id, 3.0)
        table.follow(on_b.lease_id, "b", "a", 3.0)  # the move ran: the lease counts on a, b's slot is free
        assert (table.in_use(0), table.in_use(1)) == (1, 0) and table.renew(on_b.lease_id, 3.5).chain == a
        _, next_one = table.request(1, 4.0)
        assert (await next_one).chain == b

    asyncio.run(body())
