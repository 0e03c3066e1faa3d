"""JFFC (Alg. 3): fastest free chain first, one FIFO queue, no idle capacity while jobs wait."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.dispatch import JFFC
from orchestrator.swarm_model import Chain


def chain(service_time_ms: float, capacity: int) -> Chain:
    return Chain(("s",), (1,), capacity, service_time_ms)


def test_arrivals_fill_the_fastest_chain_first_then_queue_in_fifo_order() -> None:
    jffc = JFFC([chain(300.0, 1), chain(100.0, 2)])  # chain 1 is the fastest
    assert [jffc.arrive(job) for job in "abc"] == [1, 1, 0]
    assert jffc.arrive("d") is None and jffc.arrive("e") is None
    assert jffc.queue_length == 2 and jffc.jobs_in_service == 3
    assert jffc.complete(0) == "d"  # the head starts on the chain that freed up, even the slow one
    assert jffc.busy(0) == 1 and jffc.queue_length == 1
    assert jffc.complete(1) == "e"
    assert jffc.complete(1) is None and jffc.busy(1) == 1
    assert jffc.arrive("f") == 1  # the fast chain has room again


def test_equal_rates_go_to_the_lowest_index() -> None:
    jffc = JFFC([chain(200.0, 1), chain(100.0, 1), chain(100.0, 1)])
    assert [jffc.arrive(job) for job in range(3)] == [1, 2, 0]
    assert jffc.complete(2) is None
    assert jffc.complete(1) is None
    assert jffc.arrive(3) == 1


def test_completing_an_idle_chain_is_an_error_and_zero_capacity_chains_are_never_used() -> None:
    jffc = JFFC([chain(10.0, 0), chain(50.0, 1)])
    with pytest.raises(ValueError, match="runs no job"):
        jffc.complete(1)
    assert jffc.arrive("a") == 1
    assert jffc.arrive("b") is None
    assert jffc.capacity(0) == 0 and jffc.num_chains == 2


def test_none_is_rejected_as_a_job_since_complete_gives_none_for_no_queued_job() -> None:
    jffc = JFFC([chain(10.0, 1)])
    with pytest.raises(ValueError, match="cannot be None"):
        jffc.arrive(None)
    assert jffc.jobs_in_service == 0 and jffc.queue_length == 0  # the rejected arrival left no trace
    assert jffc.arrive(0) == 0 and jffc.arrive(1) is None
    with pytest.raises(ValueError, match="cannot be None"):
        jffc.arrive(None)
    assert jffc.complete(0) == 1 and jffc.complete(0) is None


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 5), st.integers(0, 3)), min_size=1, max_size=6),
    st.lists(st.integers(0, 99), max_size=120),
)
def test_no_chain_idles_while_jobs_wait(chain_specs: list[tuple[int, int]], events: list[int]) -> None:
    """Random arrivals and completions: checked against a direct reading of Alg. 3 after every event."""
    chains = [chain(float(time), capacity) for time, capacity in chain_specs]
    jffc = JFFC(chains)
    running: list[list[int]] = [[] for _ in chains]  # jobs per chain, as the caller tracks them
    waiting: list[int] = []
    for job, event in enumerate(events):
        busy_chains = [index for index, jobs in enumerate(running) if jobs]
        if event % 3 and busy_chains:  # a completion on some busy chain
            index = busy_chains[event % len(busy_chains)]
            running[index].pop(0)
            started = jffc.complete(index)
            if waiting:
                assert started == waiting.pop(0)  # FIFO: the head starts on the freed chain
                running[index].append(started)
            else:
                assert started is None
        else:
            free = [index for index, spec in enumerate(chains) if len(running[index]) < spec.capacity]
            target = jffc.arrive(job)
            if free:
                fastest = min(free, key=lambda index: (chains[index].service_time_ms, index))
                assert target == fastest
                running[target].append(job)
            else:
                assert target is None
                waiting.append(job)
        for index, spec in enumerate(chains):
            assert jffc.busy(index) == len(running[index]) <= spec.capacity
            if waiting:  # work conservation: nothing free while anyone waits
                assert jffc.busy(index) == spec.capacity
        assert jffc.queue_length == len(waiting)


def test_with_batch_slopes_a_job_joins_the_chain_that_is_fastest_at_its_servers_present_batches() -> None:
    fast = Chain(("a",), (2,), 5, 100.0)  # a job alone: 100 ms; each job already on `a` adds 2 blocks x 15 ms
    slow = Chain(("b",), (1,), 5, 150.0)  # no slope: batching does not slow `b` down
    jffc = JFFC([fast, slow], {"a": 15.0, "b": 0.0})
    assert [jffc.arrive(job) for job in "xy"] == [0, 0]  # 100, then 130 < 150
    assert jffc.service_time_ms(0) == pytest.approx(160.0)
    assert jffc.arrive("z") == 1  # 160 > 150: the idle slow chain is faster now
    assert jffc.complete(0) is None and jffc.service_time_ms(0) == pytest.approx(130.0)
    assert jffc.arrive("w") == 0
    assert JFFC([fast, slow]).service_time_ms(0) == 100.0  # no slopes: the paper's ranking, by the time alone


def test_batch_slopes_count_the_jobs_a_server_runs_for_every_chain_through_it() -> None:
    shared_first = Chain(("a", "b"), (1, 1), 2, 100.0)
    shared_second = Chain(("a", "c"), (1, 1), 3, 110.0)
    other = Chain(("d",), (2,), 3, 125.0)
    jffc = JFFC([shared_first, shared_second, other], {"a": 10.0, "d": 10.0})
    # 100; 110 (vs 120, 125); the first is full: 130 vs 125; 130 (two on `a`) vs 145 (one on `d`, 2 blocks)
    assert [jffc.arrive(job) for job in range(4)] == [0, 0, 2, 1]
    assert jffc.service_time_ms(0) == pytest.approx(130.0) and jffc.service_time_ms(1) == pytest.approx(140.0)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 5), st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=6),
    st.lists(st.integers(0, 99), max_size=120),
)
def test_load_aware_jffc_starts_each_job_on_the_free_chain_of_least_loaded_service_time(
    chain_specs: list[tuple[int, int, int]], events: list[int],
) -> None:
    """Chains over three servers with slopes: each start checked against T_k + sum of m x slope x jobs there."""
    slopes = {"s0": 0.0, "s1": 0.7, "s2": 2.5}
    chains = [Chain((f"s{server}",), (1,), capacity, float(time)) for time, capacity, server in chain_specs]
    jffc = JFFC(chains, slopes)
    running: list[list[int]] = [[] for _ in chains]
    waiting: list[int] = []
    for job, event in enumerate(events):
        busy_chains = [index for index, jobs in enumerate(running) if jobs]
        if event % 3 and busy_chains:
            index = busy_chains[event % len(busy_chains)]
            running[index].pop(0)
            started = jffc.complete(index)
            assert started == (waiting.pop(0) if waiting else None)
            if started is not None:
                running[index].append(started)
            continue
        on_server = {name: sum(len(running[i]) for i, c in enumerate(chains) if c.servers[0] == name)
                     for name in slopes}
        free = [index for index, spec in enumerate(chains) if len(running[index]) < spec.capacity]
        loaded = {i: chains[i].service_time_ms + slopes[chains[i].servers[0]] * on_server[chains[i].servers[0]]
                  for i in free}
        target = jffc.arrive(job)
        if free:
            best = min(loaded.values())
            assert target in free and loaded[target] == pytest.approx(best)
            running[target].append(job)
        else:
            assert target is None
            waiting.append(job)


def test_standby_chains_take_a_job_only_when_no_other_chain_has_a_free_slot() -> None:
    jffc = JFFC([chain(100.0, 1), chain(200.0, 1), chain(300.0, 1)])
    jffc.set_standby([0])  # the fastest chain's server is a standby of the KV packing
    assert [jffc.arrive(job) for job in "abc"] == [1, 2, 0]  # the standby takes the third, rather than queue it
    assert jffc.arrive("d") is None
    assert jffc.complete(1) == "d"  # completions hand the slot to the queue as before
    slopes = JFFC([chain(100.0, 2), chain(200.0, 2)], {"s": 1.0})
    slopes.set_standby([1])
    assert [slopes.arrive(job) for job in "ab"] == [0, 0]
    slopes.set_standby([])
    assert slopes.arrive("c") == 1
