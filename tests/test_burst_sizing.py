"""How `benchmarks/kunserve_burst.py` sizes its arrivals and pools to the machine from a calibration run."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from benchmarks.client_work import Round, split_cost
from benchmarks.kunserve_burst import (
    BATCH_NOISE_UNTRACED,
    BATCH_TRACE_SUFFIX,
    CLIENT_WORK_FILE,
    COMPUTE_SHARE,
    CORUN_FILE,
    CROWD_DELAY_REACH_MS,
    LINK_CROSSING_FILE,
    LINK_STREAMS_FILE,
    REFUSED_TRIES_FILE,
    SIM_REPLAYS,
    TRACE,
    ArmRun,
    Calibration,
    ClientTries,
    LoadedSpeeds,
    arm_dir,
    arm_speed_scale,
    batch_noise,
    burst_requests,
    busiest_share,
    client_tries_of,
    crowd_delay_ms,
    decoded_s,
    exchange_bytes_per_s,
    kept_repeats,
    link_crossing_extra,
    loaded_block_ms,
    member_prompt_scale,
    off_by,
    other_work_weight,
    peak_sessions,
    pooled_p99_interval,
    prefill_token_ms_under_load,
    report_live_spread,
    report_pooled,
    same_arrivals,
    scaled_costs,
    sim_config,
    sim_ttfts,
    sized_pool,
    sized_rate,
    turn_fit,
)
from orchestrator.sim.kunserve_sim import KunServeSimConfig, SimRequest, simulate

WINDOW = argparse.Namespace(start=700.0, end=900.0, thin=8, prompt_scale=8.0)


@pytest.mark.skipif(not TRACE.is_file(), reason=f"the Azure code trace is missing at {TRACE}")
def test_the_sized_rate_asks_the_servers_compute_at_the_busiest_10_s_and_is_at_most_half_on_a_machine_twice_as_slow(
) -> None:
    fast, slow = LoadedSpeeds(prompt_token_ms=3.0, output_token_ms=15.0), LoadedSpeeds(6.0, 30.0)
    for speeds in (fast, slow):
        rate = sized_rate(WINDOW, speeds)
        assert busiest_share(burst_requests(WINDOW, rate), speeds) <= COMPUTE_SHARE
        assert busiest_share(burst_requests(WINDOW, rate * 1.05), speeds) > COMPUTE_SHARE
    # a 10-s window at half the rate spans half the trace's time, and the trace's peaks are denser at finer scales
    assert sized_rate(WINDOW, slow) <= sized_rate(WINDOW, fast) / 2


def test_the_busiest_share_counts_the_prompt_and_decode_work_arriving_within_10_s() -> None:
    requests = [{"id": 0, "at_s": 0.0, "prompt_tokens": 100, "output_tokens": 11},
                {"id": 1, "at_s": 9.0, "prompt_tokens": 100, "output_tokens": 11},
                {"id": 2, "at_s": 10.5, "prompt_tokens": 100, "output_tokens": 11}]
    speeds = LoadedSpeeds(prompt_token_ms=10.0, output_token_ms=100.0)  # 1 s + 10 x 0.1 s = 2 s a request
    assert busiest_share(requests, speeds) == 4.0 / 20.0  # two requests in [0, 10) or [9, 19), of 2 x 10 s


def test_the_pools_hold_a_third_of_the_sessions_the_busiest_moment_asks() -> None:
    requests = [{"id": n, "at_s": 0.5 * n, "prompt_tokens": 50, "output_tokens": 11} for n in range(12)]
    calibration = Calibration(LoadedSpeeds(5.0, 25.0), ttft_s=1.0, tbt_s=0.5, spare_sessions=1)
    assert peak_sessions(requests, calibration) == 12  # each open 6 s, all arrived within 5.5 s
    assert sized_pool(requests, calibration) == 1  # 2 sessions a server (one spare), 4 a pair: 12 asks 3x that
    without_spare = dataclasses.replace(calibration, spare_sessions=0)
    assert sized_pool(requests, without_spare) == 2
    assert sized_pool(requests[:2], without_spare) == 1  # never below one page per block


def test_the_exchange_rate_is_the_bytes_the_servers_moved_over_the_time_their_moves_took() -> None:
    def run(*moves: tuple[str, float, int, float]) -> ArmRun:
        polls = [{"t": t, "peer_id": peer, "migrations": {"bytes_out": sent, "ms_out": ms}}
                 for peer, t, sent, ms in moves]
        return ArmRun("KunServe blocking", [], polls, 0.0)

    # the last poll of each server counts: 6 MB in 2 s on one, 2 MB in 2 s on the other, in two runs
    first = run(("a", 1.0, 1_000_000, 500.0), ("a", 2.0, 6_000_000, 2000.0), ("b", 2.0, 0, 0.0))
    second = run(("b", 1.0, 2_000_000, 2000.0))
    assert exchange_bytes_per_s([first, second]) == pytest.approx(8e6 / 4.0)
    assert exchange_bytes_per_s([run(("a", 1.0, 0, 0.0))]) is None and exchange_bytes_per_s([]) is None


def test_a_loaded_step_is_the_median_of_what_the_servers_refined_their_startup_timing_to() -> None:
    def poll(peer: str, t: float, block_ms: float) -> dict:
        return {"peer_id": peer, "t": t, "block_compute_ms": block_ms}

    # `a` refines 0.8 to 1.6 and 2.0, `b` to 1.8; their unrefined polls before do not count
    polls = [poll("a", 0.0, 0.8), poll("a", 1.0, 0.8), poll("a", 2.0, 1.6), poll("a", 3.0, 2.0),
             poll("b", 0.5, 0.8), poll("b", 2.5, 1.8)]
    assert loaded_block_ms(ArmRun("no drop", [], polls, 0.0)) == pytest.approx(1.8)
    # servers that computed no lone step: their start-up timing
    assert loaded_block_ms(ArmRun("no drop", [], [poll("a", 0.0, 0.8), poll("a", 1.0, 0.8)], 0.0)) == 0.8


def test_a_prompt_tokens_cost_is_its_batches_compute_beyond_their_fixed_step_over_the_prompt_tokens() -> None:
    def poll(peer: str, t: float, tokens: int, batches: int | None, ms: float) -> dict:
        counters = {"prefill_tokens": tokens, "prefill_batch_ms": ms, "batches": 0, "compute_ms": ms}
        if batches is not None:
            counters["prefill_batches"] = batches
        return {"peer_id": peer, "t": t, "batches": counters}

    # `a` grew by 256 prompt tokens in 2 batches and 1100 ms, `b` by 128 in 1 batch and 600 ms: 3 steps of 100 ms
    polls = [poll("a", 0.0, 0, 0, 0.0), poll("a", 2.0, 256, 2, 1100.0), poll("b", 1.0, 64, 1, 300.0),
             poll("b", 3.0, 192, 2, 900.0)]
    assert prefill_token_ms_under_load(ArmRun("no drop", [], polls, 0.0), 100.0) == pytest.approx(1400 / 384)
    # servers that did not count their prompt batches: the batches' compute whole
    older = [poll("a", 0.0, 0, None, 0.0), poll("a", 2.0, 256, None, 1100.0)]
    assert prefill_token_ms_under_load(ArmRun("no drop", [], older, 0.0), 100.0) == pytest.approx(1100 / 256)


def test_the_clients_work_splits_into_a_pass_and_a_token_from_two_rounds_that_share_passes_unequally() -> None:
    lone = Round(cpu_ms=24 * (10.0 + 5.0), tokens=24, passes=24)  # a pass a token: 10 ms a pass, 5 ms a token
    shared = Round(cpu_ms=25 * 10.0 + 192 * 5.0, tokens=192, passes=25)
    assert split_cost(lone, shared) == pytest.approx((10.0, 5.0))
    # noise that would make one cost negative keeps it at 0, the other fitting the lone round
    assert split_cost(Round(240.0, 24, 24), Round(2400.0, 192, 25)) == (0.0, 10.0)
    with pytest.raises(ValueError, match="alike"):
        split_cost(lone, Round(cpu_ms=300.0, tokens=24, passes=24))


def test_an_arms_repeats_are_found_in_order_and_each_turns_simulator_is_fitted_on_that_turns_runs(
        tmp_path: Path) -> None:
    for repeat in (0, 1, 2, 4):  # the fourth turn's folder (repeat 3) is missing: the fifth is not read
        folder = arm_dir(tmp_path, 40.0, "no drop", repeat)
        folder.mkdir()
        results = [{"id": n, "arrival_s": n, "arrival_wall": 100.0 + n, "first_token_s": n + 1, "ended_s": n + 60}
                   for n in range(5)]
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
        # each turn is sized anew: its own arrivals, and here its own output lengths
        requests = [{"id": n, "at_s": n / (repeat + 1), "prompt_tokens": 8, "output_tokens": 2 + repeat * 58}
                    for n in range(5)]
        (folder / "requests.json").write_text(json.dumps(requests))
    assert [p.name for p in (arm_dir(tmp_path, 40, "no drop", n) for n in range(3))] == [
        "40-no-drop", "40-no-drop-r2", "40-no-drop-r3"]
    repeats = kept_repeats(tmp_path, 40.0, "no drop")
    assert [run.workdir for run in repeats] == [arm_dir(tmp_path, 40.0, "no drop", n) for n in range(3)]
    assert [run.requests[4]["at_s"] for run in repeats] == [4.0, 2.0, 4 / 3]
    assert [run.tbt().tolist() for run in repeats[:2]] == [[59.0] * 5, [1.0] * 5]  # 59 s over each turn's tokens
    runs = {arm: [ArmRun(arm, [], [], float(turn)) for turn in range(3)]
            for arm in ("static pipeline", "KunServe blocking", "KunServe remote attention")}
    runs["no drop"] = repeats
    runs["KunServe remote attention"] = runs["KunServe remote attention"][:1]  # it ran one turn
    base, exchanged = turn_fit(runs, 1)
    assert base is repeats[1]  # the machine's speed of that turn
    assert exchanged == [runs["KunServe blocking"][1]]  # the KV moves of that turn's runs that dropped
    assert turn_fit(runs, 0)[1] == [runs["KunServe blocking"][0], runs["KunServe remote attention"][0]]


def fit_poll(peer: str, t: float, batches: dict[str, float]) -> dict:
    """A poll of a whole server of 30 blocks at `t` (s) with the counters `batches`: start-up timings per block of
    0.5 ms a lone step and 1.2 ms a batch of 8 (0.1 ms a row more), under load (t > 0) a lone step refined to 1.0 ms."""
    return {"peer_id": peer, "t": t, "block_start": 0, "block_end": 30, "pages_total": 480, "pages_params": 420,
            "kv_tokens_per_page": 682, "kv_bytes_per_token": 1536, "block_compute_ms": 0.5 if t == 0 else 1.0,
            "block_decode_ms": [{"batch": 1, "ms": 0.5}, {"batch": 8, "ms": 1.2}], "sessions": 1, "batches": batches}


def fit_run(tmp_path: Path, polls: list[dict], tbt_s: Callable[[int], float]) -> ArmRun:
    """A no-drop run of 20 requests of 100 prompt and 11 output tokens, one a second, request n's tokens `tbt_s(n)`
    apart, its servers polled as `polls`; the client's work measured at 10 ms a pass and 5 ms a token, a refused
    try at 40 ms of CPU."""
    results = [{"id": n, "arrival_s": n, "first_token_s": n + 1.0, "ended_s": n + 1.0 + tbt_s(n) * 10}
               for n in range(20)]
    requests = {n: {"id": n, "at_s": float(n), "prompt_tokens": 100, "output_tokens": 11} for n in range(20)}
    workdir = tmp_path / "20-no-drop"
    workdir.mkdir()
    (tmp_path / CLIENT_WORK_FILE).write_text(json.dumps({
        "pass_ms": 10.0, "token_ms": 5.0, "lone": {"cpu_ms": 15.0, "tokens": 1, "passes": 1},
        "shared": {"cpu_ms": 50.0, "tokens": 8, "passes": 1}, "sessions": 8}))
    (tmp_path / REFUSED_TRIES_FILE).write_text(json.dumps({"cpu_ms": 40.0}))
    (tmp_path / CORUN_FILE).write_text(json.dumps({
        "cores": 2, "stretch": 1.1, "wall": 1.08, "cpu": 0.98, "alone_ms": 180.0, "blocks": 15, "rounds": 2}))
    return ArmRun("no drop", results, polls, 0.0, workdir, requests)


def test_the_fitted_simulator_prices_a_lone_decode_step_at_what_the_loaded_servers_took_and_adds_a_row_per_request(
        tmp_path: Path) -> None:
    # a block costs 2x its start-up timing under load (`fit_poll`): 30 ms a lone step through 30 blocks, of which a
    # row is 30 x 0.1 x 2 = 6 ms
    polls = [fit_poll(peer, t, {"prefill_tokens": 100 * t, "prefill_batches": t, "prefill_batch_ms": 424.0 * t,
                                "batches": 0, "compute_ms": 0.0}) for peer in "ab" for t in (0, 1, 2)]
    # every request's tokens 100 ms apart: beyond the lone step (30 ms) and the client's work (10 + 5 ms), 55 ms
    config = sim_config(fit_run(tmp_path, polls, lambda n: 0.1), 20.0, dropping=False)
    assert config.decode_token_ms == pytest.approx(6.0)  # a row
    assert config.step_ms + config.decode_token_ms == pytest.approx(30.0)  # a lone step: the fixed part and its row
    # a prompt batch of 100 tokens took 424 ms: its fixed part (24 ms) and 4 ms a token
    assert config.prefill_token_ms == pytest.approx(4.0)
    assert config.round_trip_ms == pytest.approx(55.0)  # the 10th percentile of TBT less the compute and client work
    assert (config.client_pass_ms, config.client_token_ms, config.refused_try_cpu_ms) == (10.0, 5.0, 40.0)
    assert config.blocks == 30 and config.params_pages == 420 and config.pages_total == 480



def test_the_fit_prices_decode_rows_on_the_start_up_batching_curve_and_takes_the_kept_corun_stretch(
        tmp_path: Path) -> None:
    # start-up timings per block: 0.5 ms a lone step, 1.2 ms a batch of 8 (0.1 ms a row), 1.68 ms a batch of 32
    # (0.02 ms a row more); under load 2x (`fit_poll`)
    polls = [fit_poll(peer, t, {"prefill_tokens": 100 * t, "prefill_batches": t, "prefill_batch_ms": 424.0 * t,
                                "batches": 0, "compute_ms": 0.0}) for peer in "ab" for t in (0, 1, 2)]
    for poll in polls:
        poll["block_decode_ms"].append({"batch": 32, "ms": 1.68})
    config = sim_config(fit_run(tmp_path, polls, lambda n: 0.1), 20.0, dropping=False)
    # a lone step through 30 blocks: 30 ms, of which the first row 6 ms (the slope from 1 to 8 rows)
    assert config.step_ms == pytest.approx(24.0)
    assert [rows for rows, _ in config.decode_rows_ms] == [1, 8, 32]
    assert [ms for _, ms in config.decode_rows_ms] == pytest.approx([6.0, 48.0, 76.8])
    assert config.decode_token_ms == pytest.approx(30 * (1.68 - 0.5) / 31 * 2)  # beside prompt tokens: 1 to 32
    assert config.corun_stretch == pytest.approx(1.1)  # as kept with the run


def test_the_batch_noise_is_the_spread_of_the_servers_batch_cpu_over_a_fit_in_their_tokens_and_rows(
        tmp_path: Path) -> None:
    """Each server's batches: CPU = 20 ms + 1 ms a prompt token + 5 ms a decode row, times a lognormal factor of
    log-sd 0.2 (a's) or exactly (b's: their log-residuals are 0); a remote-attention step, whatever its CPU, is left
    out. The pooled spread of the logs over both servers' fits is the fit's `work_noise`."""
    rng = np.random.default_rng(0)
    polls = [fit_poll(peer, t, {"prefill_tokens": 100 * t, "prefill_batches": t, "prefill_batch_ms": 424.0 * t,
                                "batches": 0, "compute_ms": 0.0}) for peer in "ab" for t in (0, 1, 2)]
    run = fit_run(tmp_path, polls, lambda n: 0.1)
    assert batch_noise(run) is None  # kept without traces: the fit takes the untraced figure
    assert sim_config(run, 20.0, dropping=False).work_noise == BATCH_NOISE_UNTRACED
    factors = {"a": np.exp(rng.normal(0.0, 0.2, 400)), "b": np.ones(400)}
    for host, factor in factors.items():
        lines = []
        for k in range(400):
            prompt, rows = (k * 37) % 129, (k * 11) % 9
            steps = [["p", prompt, False, 0.0]] * (prompt > 0) + [["d", 1, True, 0.0]] * rows
            lines.append({"place": "pool", "cpu_ms": (20 + prompt + 5 * rows) * factor[k], "steps": steps})
        lines.append({"place": "remote", "cpu_ms": 5000.0, "steps": [["d", 1, True, 0.0]]})
        (run.workdir / f"{host}{BATCH_TRACE_SUFFIX}").write_text("".join(json.dumps(line) + "\n" for line in lines))
    logs = np.concatenate([np.log(factors["a"]) - np.log(factors["a"]).mean(), np.zeros(400)])
    assert batch_noise(run) == pytest.approx(logs.std(), rel=0.05)
    assert sim_config(run, 20.0, dropping=False).work_noise == pytest.approx(batch_noise(run))


def test_the_fit_takes_the_links_crossing_kept_with_the_run_and_measures_none_itself(tmp_path: Path) -> None:
    polls = [fit_poll(peer, t, {"prefill_tokens": 100 * t, "prefill_batches": t, "prefill_batch_ms": 424.0 * t,
                                "batches": 0, "compute_ms": 0.0}) for peer in "ab" for t in (0, 1, 2)]
    run = fit_run(tmp_path, polls, lambda n: 0.1)
    assert sim_config(run, 20.0, dropping=False).client_link_extra_s == ()  # none kept: every message at line rate
    # kept: 100 Mbit/s is 80 us a kB; a 100 kB message sent after another 9 ms, returned 11 ms: 2 ms beyond 8 ms
    (tmp_path / LINK_CROSSING_FILE.format(rtt="20")).write_text(json.dumps({
        "rtt_ms": 20.0, "sizes": [1000, 100_000], "idle_s": [0.0, 0.008], "busy_s": [0.0, 0.009],
        "down_s": [0.0, 0.011], "small_call_s": 0.021, "measured": "2026-12-05T22:18:11"}))
    extra = sim_config(run, 20.0, dropping=False).client_link_extra_s
    assert [size for size, _ in extra] == [1000, 100_000]
    assert [seconds for _, seconds in extra] == pytest.approx([0.0, 0.002])
    # from r93 the kept reading also has new streams' crossings (sent 20 ms, received 24 ms): the fit takes those, as
    # each session's prompt crosses on a stream it opened
    (tmp_path / LINK_STREAMS_FILE.format(rtt="20")).write_text(json.dumps({
        "rtt_ms": 20.0, "sizes": [1000, 100_000], "idle_s": [0.0, 0.008], "busy_s": [0.0, 0.009],
        "down_s": [0.0, 0.011], "small_call_s": 0.021, "fresh_up_s": [0.0, 0.020], "fresh_down_s": [0.001, 0.024],
        "measured": "2026-12-07T08:00:00"}))
    extra = sim_config(run, 20.0, dropping=False).client_link_extra_s
    assert [seconds for _, seconds in extra] == pytest.approx([0.0005 - 0.00008, 0.014])
    assert link_crossing_extra(tmp_path, 40.0) == ()  # nothing kept at 40 ms, and the fit measures nothing


def test_an_arms_speed_scales_every_cpu_cost_of_the_fit_and_no_network_time(tmp_path: Path) -> None:
    polls = [fit_poll(peer, t, {"prefill_tokens": 100 * t, "prefill_batches": t, "prefill_batch_ms": 424.0 * t,
                                "batches": 0, "compute_ms": 0.0}) for peer in "ab" for t in (0, 1, 2)]
    fitted = sim_config(fit_run(tmp_path, polls, lambda n: 0.1), 20.0, dropping=False)
    fitted = dataclasses.replace(fitted, token_cpu_ms=6.0)  # as a run whose processes were sampled gives it
    slower = scaled_costs(fitted, 1.5)
    costs = ("step_ms", "decode_token_ms", "prefill_token_ms", "client_pass_ms", "client_token_ms", "token_cpu_ms",
             "refused_try_cpu_ms")
    assert all(getattr(fitted, name) > 0 for name in costs)
    for name in costs:
        assert getattr(slower, name) == pytest.approx(1.5 * getattr(fitted, name)), name
    assert fitted.decode_rows_ms and [ms for _, ms in slower.decode_rows_ms] == pytest.approx(
        [1.5 * ms for _, ms in fitted.decode_rows_ms])
    unscaled = {field.name for field in dataclasses.fields(fitted)} - {*costs, "decode_rows_ms"}
    assert {name for name in unscaled if getattr(slower, name) != getattr(fitted, name)} == set()  # hops, links


def test_the_pooled_report_takes_every_kept_runs_requests_live_and_every_replay_of_each_simulated(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # servers that counted their CPU, as the headline's speed needs (`arm_speed_scale`)
    polls = [fit_poll(peer, t, {"prefill_tokens": 100 * t, "prefill_batches": t, "prefill_batch_ms": 424.0 * t,
                                "prefill_batch_cpu_ms": 400.0 * t, "batches": 2 * t, "compute_ms": 530.0 * t,
                                "cpu_ms": 500.0 * t}) for peer in "ab" for t in (0, 1, 2)]
    kept = []
    for index in range(2):
        (tmp_path / f"r{index}").mkdir()
        run = fit_run(tmp_path / f"r{index}", polls, lambda n: 0.1)
        for result in run.results:  # TTFTs of 1.0-2.9 s, and 3.0-4.9 in the second run
            result["first_token_s"] = result["arrival_s"] + 1.0 + 2 * index + result["id"] / 10
        for request in run.requests.values():  # and prompts twice as long, so that its simulated TTFTs differ too
            request["prompt_tokens"] *= 1 + index
        kept.append({"no drop": [run]})
    report_pooled(20.0, kept)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("no drop"))
    live = np.concatenate([runs["no drop"][0].ttft() for runs in kept])
    each = [np.concatenate(sim_ttfts(runs["no drop"][0], 20.0, "no drop")) for runs in kept]
    assert np.percentile(each[1], 50) > np.percentile(each[0], 50)
    sim = np.concatenate(each)
    assert live.size == 40 and sim.size == 40 * SIM_REPLAYS
    assert "2 runs, 40 requests: live " + " / ".join(f"{q:.2f}" for q in np.percentile(live, [50, 95, 99])) in line
    assert "sim " + " / ".join(f"{q:.2f}" for q in np.percentile(sim, [50, 95, 99])) + " s" in line
    assert f"P99 off by {off_by(np.percentile(live, 99), np.percentile(sim, 99)):.0%}" in line
    low, high = pooled_p99_interval([runs["no drop"][0].ttft() for runs in kept])
    assert low < np.percentile(live, 99) <= high
    assert f"the live P99 drawn again {low:.2f}-{high:.2f} s (5-95%)" in line


def test_the_pooled_p99s_interval_draws_whole_runs_before_their_requests() -> None:
    # a run whose waits were all 1 s and one whose were all 3 s: the pooled P99 is 3 s, and only drawing runs (both
    # draws the first run a quarter of the time) moves it; drawing requests alone would leave it at 3 s
    assert pooled_p99_interval([np.full(50, 1.0), np.full(50, 3.0)]) == (1.0, 3.0)
    assert pooled_p99_interval([np.full(50, 2.0)] * 3) == (2.0, 2.0)
    assert pooled_p99_interval([np.full(50, 1.0), np.full(50, 3.0)], seed=1) == (1.0, 3.0)  # seeded, not luck


def test_a_clients_try_is_fitted_as_a_dht_lookup_where_its_route_made_one_and_an_open_call_per_server() -> None:
    # three rounds: one routed on fresh records (1 ms), two looked the DHT up (0.13 and 0.15 s); opens of 20-30 ms,
    # one refused by a busy server
    attempts = [[["route", 0.0, 0.13, None, "ok"], ["open", 0.13, 0.15, "a", "ok"], ["open", 0.15, 0.18, "b", "ok"]],
                [["route", 1.0, 1.001, None, "ok"], ["open", 1.001, 1.026, "a", "ServerBusy"],
                 ["backoff", 1.026, 1.526, None, "0.5"]],
                [["route", 2.0, 2.15, None, "ok"], ["open", 2.15, 2.175, "a", "ok"]]]
    run = ArmRun("no drop", [{"id": n, "open_attempts": rows} for n, rows in enumerate(attempts)], [], 0.0)
    tries = client_tries_of(run)
    assert tries.lookup_s == pytest.approx(0.14)  # the median of the routes that looked up; the 1-ms one did not
    assert tries.open_s == pytest.approx(0.025)  # the median of every open, admitted or refused
    unlogged = ArmRun("no drop", [{"id": 0}], [], 0.0)  # recorded before clients logged their attempts
    assert client_tries_of(unlogged) == ClientTries(0.0, 0.0)


def test_where_the_servers_counted_cpu_the_fit_takes_a_tokens_delay_from_all_of_the_no_drop_requests(
        tmp_path: Path) -> None:
    # the same servers, counting their batches' CPU time (wall 1.06x it); half the requests decoded at 100 ms a token
    # (the least loaded: a 55 ms delay beyond the work), half at 250 ms
    polls = [fit_poll(peer, t, {"prefill_tokens": 100 * t, "prefill_batches": t, "prefill_batch_ms": 424.0 * t,
                                "prefill_batch_cpu_ms": 400.0 * t, "batches": 2 * t, "compute_ms": 530.0 * t,
                                "cpu_ms": 500.0 * t}) for peer in "ab" for t in (0, 1, 2)]
    base = fit_run(tmp_path, polls, lambda n: 0.1 if n % 2 else 0.25)
    config = sim_config(base, 20.0, dropping=False)
    assert config.prefill_token_ms == pytest.approx(4.0 / (424 / 400))  # a prompt token at its CPU time
    # the least loaded requests' figure, and more for each other request decoding
    assert config.round_trip_ms < 55.0 + 5 and config.round_trip_per_decoding_ms > 5.0
    as_recorded = [SimRequest(r["at_s"], r["prompt_tokens"], r["output_tokens"]) for r in base.requests.values()]
    # as long as the live requests decoded, to the steps of a simulation whose decode time jumps a few percent as its
    # batches fall in and out of step (the least loaded figure: 28.4 s against 35)
    assert decoded_s(simulate(config, as_recorded), as_recorded) == pytest.approx(base.decode_s(), rel=0.05)


def test_the_servers_batch_cpu_is_their_prompt_cpu_per_token_and_block_and_their_wall_over_cpu() -> None:
    def poll(peer: str, t: float, blocks: int, cpu: float, wall: float, prompt_cpu: float, tokens: int) -> dict:
        return {"peer_id": peer, "t": t, "block_start": 0, "block_end": blocks, "sessions": 1,
                "batches": {"cpu_ms": cpu, "compute_ms": wall, "prefill_batch_cpu_ms": prompt_cpu,
                            "prefill_batch_ms": 1.2 * prompt_cpu, "prefill_tokens": tokens, "batches": 0,
                            "prefill_batches": 0}}

    # `a` hosts 30 blocks: 600 ms CPU (300 of it for 100 prompt tokens) in 900 ms; then drops to 15 blocks, an
    # interval that does not count, and computes 100 ms CPU (75 for 50 tokens) in 100 ms
    polls = [poll("a", 0.0, 30, 0, 0, 0, 0), poll("a", 1.0, 30, 600, 900, 300, 100),
             poll("a", 2.0, 15, 700, 1000, 350, 120), poll("a", 3.0, 15, 800, 1100, 425, 170)]
    cpu = ArmRun("KunServe blocking", [], polls, 0.0).batch_cpu()
    assert cpu is not None
    assert cpu.prompt_us_per_token_block == pytest.approx(1000 * (300 / 30 + 75 / 15) / 150)  # 100 us
    assert cpu.wall_over_cpu == pytest.approx(1000 / 700)
    assert cpu.prompt_wall_over_cpu == pytest.approx(1.2)
    # servers that did not count their CPU
    older = [{**row, "batches": {k: v for k, v in row["batches"].items() if "cpu" not in k}} for row in polls]
    assert ArmRun("no drop", [], older, 0.0).batch_cpu() is None
    # an arm's speed against the no-drop run's: its CPU per prompt token and block over theirs
    run = ArmRun("KunServe blocking", [], polls, 0.0)
    whole = ArmRun("no drop", [], polls[:2], 0.0)  # 300 ms for 100 tokens through 30 blocks: 100 us
    assert arm_speed_scale(whole, run) == pytest.approx(1.0)
    faster = [poll("b", 0.0, 30, 0, 0, 0, 0), poll("b", 1.0, 30, 400, 500, 240, 100)]  # 80 us
    assert arm_speed_scale(ArmRun("no drop", [], faster, 0.0), run) == pytest.approx(100 / 80)
    assert arm_speed_scale(ArmRun("no drop", [], older, 0.0), run) is None
    assert arm_speed_scale(whole, ArmRun("KunServe blocking", [], older, 0.0)) is None


def test_the_other_works_weight_is_fitted_so_the_simulated_no_drop_batches_stretch_as_the_live_ones_did() -> None:
    # two replicas on two cores; a client keeps waiting (one request's room each) and its refused tries take CPU
    config = KunServeSimConfig(replicas=2, blocks=8, pages_total=100, params_pages=40, tokens_per_page=64,
                               step_ms=10.0, prefill_token_ms=0.5, decode_token_ms=2.0, dropping=False, cores=2,
                               retry_backoff_s=(0.2, 1.0), refused_try_cpu_ms=300.0, lookup_s=0.05)
    requests = {n: {"id": n, "at_s": 0.05 * n, "prompt_tokens": 200, "output_tokens": 100} for n in range(8)}
    base = ArmRun("no drop", [], [], 0.0, None, requests)
    as_recorded = [SimRequest(r["at_s"], r["prompt_tokens"], r["output_tokens"]) for r in requests.values()]

    def stretch(weight: float) -> float:
        return simulate(dataclasses.replace(config, other_work_weight=weight), as_recorded).compute_stretch

    assert stretch(0.0) < stretch(3.0) < stretch(8.0)
    weight = other_work_weight(base, config, stretch(3.0))
    assert stretch(weight) == pytest.approx(stretch(3.0), rel=0.02)
    assert other_work_weight(base, config, 100.0) == weight  # kept on the run for the fit's round trip
    # beyond what the range reaches: its ends
    assert other_work_weight(ArmRun("no drop", [], [], 0.0, None, requests), config, 100.0) == 8.0
    assert other_work_weight(ArmRun("no drop", [], [], 0.0, None, requests), config, 0.5) == 0.0


def test_a_tokens_delay_per_decoding_request_is_fitted_so_simulated_no_drop_requests_decode_as_long_as_live() -> None:
    # two replicas and their client on two cores, with waiting clients' refused tries
    config = KunServeSimConfig(replicas=2, blocks=8, pages_total=100, params_pages=40, tokens_per_page=64,
                               step_ms=10.0, prefill_token_ms=0.5, decode_token_ms=2.0, round_trip_ms=20.0,
                               dropping=False, cores=2, retry_backoff_s=(0.2, 1.0), refused_try_cpu_ms=300.0,
                               lookup_s=0.05)
    requests = {n: {"id": n, "at_s": 0.05 * n, "prompt_tokens": 200, "output_tokens": 100} for n in range(8)}
    as_recorded = [SimRequest(r["at_s"], r["prompt_tokens"], r["output_tokens"]) for r in requests.values()]

    def decoding(per_decoding_ms: float) -> float:
        return decoded_s(simulate(dataclasses.replace(config, round_trip_per_decoding_ms=per_decoding_ms),
                                  as_recorded), as_recorded)

    def live(decode_s: float) -> ArmRun:  # a no-drop run whose requests decoded that long in all
        return ArmRun("no drop", [{"id": 0, "first_token_s": 0.0, "ended_s": decode_s}], [], 0.0, None, requests)

    assert decoding(0.0) < decoding(15.0) < decoding(CROWD_DELAY_REACH_MS)
    base = live(decoding(15.0))
    per_decoding_ms = crowd_delay_ms(base, config)
    assert per_decoding_ms == pytest.approx(15.0, abs=0.5)
    assert decoding(per_decoding_ms) == pytest.approx(decoding(15.0), rel=0.01)
    assert crowd_delay_ms(base, config) == per_decoding_ms  # kept on the run
    assert base.decode_s() == pytest.approx(decoding(15.0))
    # never below the least loaded requests' figure, at most `CROWD_DELAY_REACH_MS` more for each request decoding
    assert crowd_delay_ms(live(decoding(0.0) / 2), config) == 0.0
    assert crowd_delay_ms(live(decoding(CROWD_DELAY_REACH_MS) * 2), config) == CROWD_DELAY_REACH_MS


def test_a_members_prompt_scale_is_its_cpu_per_token_and_block_over_the_whole_servers_where_both_counted_it() -> None:
    def poll(t: float, blocks: int, prompt_ms: float, prompt_cpu_ms: float | None, tokens: int) -> dict:
        counters = {"compute_ms": prompt_ms, "prefill_batch_ms": prompt_ms, "prefill_tokens": tokens,
                    "batches": tokens // 100, "prefill_batches": tokens // 100}
        if prompt_cpu_ms is not None:
            counters |= {"cpu_ms": prompt_cpu_ms, "prefill_batch_cpu_ms": prompt_cpu_ms}
        return {"peer_id": "a", "t": t, "block_start": 0, "block_end": blocks, "sessions": 1, "batches": counters}

    # whole servers: 100 tokens through 30 blocks in 600 ms wall, 400 ms CPU (200 and 133 us per token and block);
    # a member of 15 blocks: 100 tokens in 450 ms wall (contended: 300 us), 150 ms CPU (100 us)
    whole = ArmRun("no drop", [], [poll(0, 30, 0, 0, 0), poll(1, 30, 600, 400, 100)], 0.0)
    member = ArmRun("static pipeline", [], [poll(0, 15, 0, 0, 0), poll(1, 15, 450, 150, 100)], 0.0)
    assert member_prompt_scale(whole, member) == pytest.approx(100 / (400 / 30 * 10))  # 0.75: CPU against CPU
    # runs recorded before the servers counted CPU: wall time against wall time
    whole_wall = ArmRun("no drop", [], [poll(0, 30, 0, None, 0), poll(1, 30, 600, None, 100)], 0.0)
    member_wall = ArmRun("static pipeline", [], [poll(0, 15, 0, None, 0), poll(1, 15, 450, None, 100)], 0.0)
    assert member_prompt_scale(whole_wall, member_wall) == pytest.approx(1.5)
    assert member_prompt_scale(whole, whole) is None  # never hosted a slice


def test_the_live_runs_are_held_against_their_own_median_only_where_every_turn_replayed_the_same_requests(
        capsys: pytest.CaptureFixture[str]) -> None:
    requests = {n: {"id": n, "at_s": 0.5 * n, "prompt_tokens": 100, "output_tokens": 10} for n in range(100)}

    def run(arm: str, ttft_s: float, replayed: dict[int, dict] = requests) -> ArmRun:
        # 100 requests: the P99 is within the two slowest, both `ttft_s`
        results = [{"id": n, "arrival_s": 0.0, "first_token_s": ttft_s if n >= 98 else 0.1, "ended_s": 9.0}
                   for n in range(100)]
        return ArmRun(arm, results, [], 0.0, None, replayed)

    # no drop: 10, 11 and 14 s, median 11: off by 10%, 0% and 21%
    runs = {"no drop": [run("no drop", 10.0), run("no drop", 11.0), run("no drop", 14.0)],
            "static pipeline": [run("static pipeline", 2.0), run("static pipeline", 2.0), run("static pipeline", 2.2)]}
    assert same_arrivals(runs["no drop"])
    report_live_spread(runs)
    printed = capsys.readouterr().out
    assert "10.00 s off by 10%, 11.00 s off by 0%, 14.00 s off by 21%" in printed
    assert "2.20 s off by 9%" in printed
    assert "5 of 6 runs within 15% of their arm's median" in printed
    # turns sized by their own calibrations replay different requests: nothing to hold them against
    moved = {n: {**request, "at_s": request["at_s"] * 1.1} for n, request in requests.items()}
    runs["no drop"][2] = run("no drop", 14.0, moved)
    assert not same_arrivals(runs["no drop"]) and not same_arrivals(runs["no drop"][:1])
    report_live_spread(runs)
    assert capsys.readouterr().out == ""
    # one turn: no arm has runs to hold against each other
    report_live_spread({"no drop": [run("no drop", 10.0)], "static pipeline": [run("static pipeline", 2.0)]})
    assert capsys.readouterr().out == ""
