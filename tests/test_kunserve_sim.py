"""The KunServe simulator: replicas that throttle on KV pages under a burst, the live policies merging them into
buddy groups and splitting them back, and its two baselines, on small deterministic workloads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from orchestrator.sim.kunserve_sim import KunServeSimConfig, SimRequest, simulate

# 4 replicas of 8 blocks; 100 pages each, 40 of parameters: 60 KV pages, 7 requests of 64 tokens (8 pages) each.
CONFIG = KunServeSimConfig(
    replicas=4, blocks=8, pages_total=100, params_pages=40, tokens_per_page=64, step_ms=10.0,
    prefill_token_ms=0.05, decode_token_ms=0.1, hop_ms=1.0, link_bytes_per_s=1e9, prefill_chunk_tokens=256,
    restore_after_s=2.0,
)


def burst(calm: int = 20, burst: int = 60) -> list[SimRequest]:
    """A calm rate, then a burst of `burst` requests within 0.2 s, then calm again."""
    requests = [SimRequest(0.5 * i, 16, 48) for i in range(calm)]
    requests += [SimRequest(10.0 + 0.2 * i / burst, 16, 48) for i in range(burst)]
    requests += [SimRequest(12.0 + 0.5 * i, 16, 48) for i in range(calm)]
    return sorted(requests, key=lambda r: r.arrival_s)


def test_every_request_is_served_once_with_its_tokens_timed() -> None:
    result = simulate(CONFIG, burst())
    assert np.isfinite(result.ttft_s).all() and np.isfinite(result.tbt_s).all()
    assert (result.ttft_s > 0).all() and (result.tbt_s >= CONFIG.step_ms / 1000).all()
    assert result.end_s >= max(r.arrival_s for r in burst())


def test_a_burst_makes_the_replicas_drop_and_restore_and_cuts_the_tail_ttft() -> None:
    requests = burst()
    kunserve = simulate(CONFIG, requests)
    no_drop = simulate(dataclasses.replace(CONFIG, dropping=False), requests)
    assert kunserve.drops >= 1 and kunserve.restores == kunserve.drops and kunserve.largest_group >= 2
    assert no_drop.drops == 0 and no_drop.stalls_s == ()
    assert kunserve.percentile(kunserve.ttft_s, 99) < no_drop.percentile(no_drop.ttft_s, 99)
    assert len(kunserve.stalls_s) >= 1 and min(kunserve.stalls_s) > 0  # victims waited for their KV
    # capacity grew by the dropped copies' parameter pages while dropped, and came back after
    capacities = {capacity for _, _, capacity in kunserve.samples}
    assert 4 * 60 in capacities and max(capacities) > 4 * 60


def test_a_static_pipeline_pays_its_hops_when_unloaded() -> None:
    calm = [SimRequest(1.0 * i, 16, 48) for i in range(10)]
    replicas = simulate(dataclasses.replace(CONFIG, dropping=False), calm)
    pipeline = simulate(dataclasses.replace(CONFIG, static_groups=2), calm)
    assert pipeline.drops == 0
    extra_ms = (np.nanmedian(pipeline.tbt_s) - np.nanmedian(replicas.tbt_s)) * 1000
    assert extra_ms == pytest.approx(CONFIG.hop_ms)  # one more member, one hop per token


def test_the_simulation_is_a_pure_function_of_its_inputs() -> None:
    first, second = simulate(CONFIG, burst()), simulate(CONFIG, burst())
    assert np.array_equal(first.ttft_s, second.ttft_s) and first.samples == second.samples


def test_bad_configurations_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of blocks"):
        dataclasses.replace(CONFIG, params_pages=41)
    with pytest.raises(ValueError, match="divide"):
        dataclasses.replace(CONFIG, static_groups=3)


def test_clients_that_back_off_are_served_later_than_a_queue_and_still_trigger_drops() -> None:
    requests = burst()
    queue = simulate(dataclasses.replace(CONFIG, dropping=False), requests)
    backoff = simulate(dataclasses.replace(CONFIG, dropping=False, retry_backoff_s=(0.5, 4.0)), requests)
    assert np.isfinite(backoff.ttft_s).all()
    assert backoff.percentile(backoff.ttft_s, 99) >= queue.percentile(queue.ttft_s, 99)
    dropping = simulate(dataclasses.replace(CONFIG, retry_backoff_s=(0.5, 4.0)), requests)
    assert dropping.drops >= 1
    assert dropping.percentile(dropping.ttft_s, 99) < backoff.percentile(backoff.ttft_s, 99)


def test_a_tokens_round_trip_delays_it_but_leaves_its_server_free_for_other_requests() -> None:
    lone_replica = dataclasses.replace(CONFIG, replicas=1, dropping=False, round_trip_ms=100.0)
    first = SimRequest(0.0, 16, 48)
    alone = simulate(lone_replica, [first])
    without = simulate(dataclasses.replace(lone_replica, round_trip_ms=0.0), [first])
    assert alone.tbt_s[0] - without.tbt_s[0] == pytest.approx(0.1)  # every token waits its round trip
    assert alone.ttft_s[0] - without.ttft_s[0] == pytest.approx(0.1)
    # a second request arriving mid-way through the first's round trip computes while the first's token travels:
    # the first request's pace does not change
    both = simulate(lone_replica, [first, SimRequest(0.05, 16, 48)])
    assert both.tbt_s[0] == pytest.approx(alone.tbt_s[0])
    assert np.isfinite(both.tbt_s).all()
