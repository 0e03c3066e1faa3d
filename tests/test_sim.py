"""The simulator: determinism, workloads, presets, the engine's own checks, and agreement with the queueing analysis."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.analysis import exact_two_chain_mean_response, mean_response_bounds
from orchestrator.cli import main as swarm_sim
from orchestrator.dispatch import JFFCPolicy
from orchestrator.dispatch_policy import Route, Start
from orchestrator.sim.engine import CapacityViolation, PolicyError, simulate
from orchestrator.sim.methods import FIG8_POLICIES
from orchestrator.sim.overall import (
    fig8,
    fig8_cell,
    fig8_table,
    non_wins,
    paired_comparison,
    paired_comparisons,
    paired_verdicts,
)
from orchestrator.sim.presets import (
    HIGH_PERFORMANCE,
    INPUT_TOKENS,
    LOW_PERFORMANCE,
    OUTPUT_TOKENS,
    load_ripe_rtt,
    paper_swarm,
    per_block_time_ms,
    synthetic_rtt,
)
from orchestrator.sim.report import write_json
from orchestrator.sim.workload import (
    Trace,
    Workload,
    load_azure_trace,
    poisson_workload,
    trace_workload,
    with_mean_lengths,
)
from orchestrator.swarm_model import Chain, ModelSpec, Placement, ServerSpec, SwarmModel

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
RIPE = DATA / "ripe_atlas_eu_rtt.csv"
AZURE_CONV = DATA / "azure_llm_inference_2023_conv.csv"


def one_block_chains(rates_per_ms: list[float], capacities: list[int]) -> tuple[SwarmModel, Placement, list[Chain]]:
    """Gives a swarm where chain k is one server hosting the single block, with exactly c_k cache slots."""
    model = ModelSpec(blocks=1, block_gb=1.0, cache_gb=1.0)
    servers = tuple(
        ServerSpec(f"k{k}", 1.0 + capacity, 0.0, 1.0 / rate)
        for k, (rate, capacity) in enumerate(zip(rates_per_ms, capacities, strict=True))
    )
    placement = Placement({server.name: (1, 1) for server in servers})
    chains = [Chain((s.name,), (1,), c, s.tau_p_ms) for s, c in zip(servers, capacities, strict=True)]
    return SwarmModel(model, servers), placement, chains


def batch_means(values: np.ndarray, batches: int = 20) -> tuple[float, float]:
    """Gives the mean and a 95% half-width from `batches` consecutive batch means (t quantile for 19 d.o.f.)."""
    usable = values[: values.size - values.size % batches].reshape(batches, -1).mean(axis=1)
    return float(usable.mean()), 2.093 * float(usable.std(ddof=1)) / math.sqrt(batches)


def test_same_seed_gives_identical_json_and_another_seed_differs(tmp_path):
    """Also across interpreters with other string hash seeds: nothing may depend on set or dict order."""
    args = ["run", "--jobs", "300", "--no-progress", "--no-plot", "--servers", "30", "--eta", "0.3",
            "--policy", "proposed,petals,bprr,parallax,helix,jsq"]
    paths = [tmp_path / name for name in ("a.json", "b.json", "c.json")]
    assert swarm_sim([*args, "--seed", "3", "--json", str(paths[0])]) == 0
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    command = [sys.executable, "-m", "orchestrator.cli", *args, "--seed", "3", "--json", str(paths[1])]
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=120, cwd=Path(__file__).parents[1])
    assert swarm_sim([*args, "--seed", "4", "--json", str(paths[2])]) == 0
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()


def test_run_reads_a_yaml_swarm_and_reports_an_infeasible_policy(tmp_path, capsys):
    spec = tmp_path / "swarm.yaml"
    spec.write_text(
        "model: {blocks: 8, block_gb: 1.0, cache_gb: 0.1}\n"
        "servers:\n"
        + "".join(f"  - {{name: s{i}, memory_gb: {4 + i}, tau_c_ms: 20, tau_p_ms: {50 + 10 * i}}}\n" for i in range(5))
        + "arrival_rate: 2.0\nrho_bar: 0.7\n"
    )
    out = tmp_path / "out.json"
    code = swarm_sim(["run", "--spec", str(spec), "--jobs", "200", "--no-progress", "--no-plot", "--json", str(out),
                      "--policy", "proposed,jffc-only,petals"])
    assert code == 0
    text = capsys.readouterr().out
    assert "no server fits the whole model" in text and "proposed" in text
    assert '"infeasible"' in out.read_text()


def test_engine_rejects_a_policy_that_overfills_a_server():
    swarm, placement, _ = one_block_chains([1.0], [1])

    class Greedy:  # starts every job at once, ignoring the single slot
        name, placement, chains = "greedy", None, ()

        def __init__(self, placement):
            self.placement = placement

        def arrive(self, job, now_ms):
            return [Start(job, Route(("k0",), (1,), 1.0))]

        def complete(self, job, now_ms):
            return []

    workload = Workload(np.array([0.0, 0.0]), np.array([1.0, 1.0]), "two at once")
    with pytest.raises(CapacityViolation):
        simulate(Greedy(placement), workload, swarm)


def test_engine_rejects_a_route_that_skips_blocks():
    model = ModelSpec(blocks=4, block_gb=1.0, cache_gb=1.0)
    swarm = SwarmModel(model, (ServerSpec("a", 10.0, 1.0, 1.0), ServerSpec("b", 10.0, 1.0, 1.0)))
    placement = Placement({"a": (1, 2), "b": (3, 2)})

    class Skipper:
        name, chains = "skipper", ()

        def __init__(self):
            self.placement = placement

        def arrive(self, job, now_ms):
            return [Start(job, Route(("b",), (2,), 3.0))]

        def complete(self, job, now_ms):
            return []

    with pytest.raises(PolicyError):
        simulate(Skipper(), Workload(np.array([0.0]), np.array([1.0]), "one"), swarm)


class Scripted:
    """A policy that starts every job on arrival, on the route `routes[job]`, over the chains of `one_block_chains`."""

    name = "scripted"

    def __init__(self, placement, chains, routes):
        self.placement, self.chains, self.routes = placement, chains, routes

    def arrive(self, job, now_ms):
        return [Start(job, self.routes[job])]

    def complete(self, job, now_ms):
        return []


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (lambda chains: Route(chains[0].servers, (1,), chains[0].service_time_ms, 7), "chain 7 of 2"),  # no chain 7
        (lambda chains: Route.of_chain(chains[0], 1), "names chain 1"),  # chain 0's servers, counted against chain 1
    ],
)
def test_engine_rejects_a_route_naming_a_missing_or_another_chain_even_after_checking_its_servers(second, message):
    swarm, placement, chains = one_block_chains([1.0, 0.5], [2, 2])
    routes = [Route.of_chain(chains[0], 0), second(chains)]  # the first start puts chain 0's servers in the cache
    workload = Workload(np.array([0.0, 1.0]), np.array([1.0, 1.0]), "two jobs")
    with pytest.raises(PolicyError, match=message):
        simulate(Scripted(placement, chains, routes), workload, swarm)


def test_engine_rejects_a_route_whose_service_time_is_not_its_hops_time():
    swarm, placement, chains = one_block_chains([1.0, 0.5], [2, 2])
    workload = Workload(np.array([0.0, 1.0]), np.array([1.0, 1.0]), "two jobs")
    path = Route(("k1",), (1,), 2.0)  # k1 takes tau_p = 2 ms for the block
    rounded = Route(("k1",), (1,), 2.0 * (1 + 1e-12))  # the same hops summed in another order: accepted
    assert simulate(Scripted(placement, chains, [path, rounded]), workload, swarm).response_ms.size == 2
    with pytest.raises(PolicyError, match="service time"):
        simulate(Scripted(placement, chains, [path, Route(("k1",), (1,), 1.0)]), workload, swarm)
    faster_chain = Route(chains[1].servers, chains[1].blocks_per_server, 1.0, 1)  # chain 1 claiming chain 0's speed
    with pytest.raises(PolicyError):
        simulate(Scripted(placement, chains, [path, faster_chain]), workload, swarm)


@pytest.mark.parametrize("instance", range(6))
def test_theorem_37_bounds_bracket_simulated_jffc_on_random_instances(instance):
    rng = np.random.default_rng([2024, instance])
    chains = int(rng.integers(2, 4))
    rates = sorted(rng.uniform(0.2, 2.0, size=chains).tolist(), reverse=True)
    capacities = rng.integers(1, 4, size=chains).tolist()
    nu = sum(r * c for r, c in zip(rates, capacities, strict=True))
    arrival = float(rng.uniform(0.3, 0.85)) * nu
    swarm, placement, chain_list = one_block_chains(rates, capacities)
    lower, upper = mean_response_bounds(arrival, rates, capacities)
    workload = poisson_workload(arrival, 40_000, np.random.default_rng([2024, instance, 1]))
    result = simulate(JFFCPolicy(chain_list, placement), workload, swarm, warmup_jobs=2000)
    mean, half = batch_means(result.response_ms)
    margin = 3 * half + 0.01 * mean
    assert lower - margin <= mean <= upper + margin, (lower, mean, upper, half)


def test_exact_two_chain_response_matches_a_long_simulation():
    rates, capacities, arrival = [1.0, 0.3], [2, 3], 1.0
    exact = exact_two_chain_mean_response(arrival, rates, capacities)
    assert exact == pytest.approx(1.456, abs=5e-4)
    swarm, placement, chains = one_block_chains(rates, capacities)
    workload = poisson_workload(arrival, 120_000, np.random.default_rng(7))
    result = simulate(JFFCPolicy(chains, placement), workload, swarm, warmup_jobs=5000)
    mean, half = batch_means(result.response_ms, batches=30)
    assert abs(mean - exact) <= 3 * half, (mean, half, exact)
    assert half < 0.03 * exact  # the run is long enough for the comparison to mean something


def test_poisson_workload_has_the_requested_rate_and_unit_sizes():
    workload = poisson_workload(0.002, 20_000, np.random.default_rng(1))
    assert workload.rate_per_ms == pytest.approx(0.002, rel=0.03)
    assert workload.sizes.mean() == pytest.approx(1.0, rel=0.03)
    assert workload.arrivals_ms[0] == 0.0 and np.all(np.diff(workload.arrivals_ms) >= 0)


def test_paper_gpu_types_give_the_papers_per_block_times():
    assert per_block_time_ms(HIGH_PERFORMANCE, INPUT_TOKENS, OUTPUT_TOKENS) == pytest.approx(109, abs=0.5)
    assert per_block_time_ms(LOW_PERFORMANCE, INPUT_TOKENS, OUTPUT_TOKENS) == pytest.approx(175, abs=0.5)


def test_paper_swarm_has_round_eta_j_fast_servers_and_rtt_based_tau_c():
    instance = paper_swarm(30, 0.3, seed=5, rtt=synthetic_rtt())
    fast = [s for s in instance.swarm.servers if s.memory_gb == 40.0]
    assert len(fast) == 9 and tuple(s.name for s in fast) == instance.high_performance
    assert all(s.tau_c_ms > 18.0 for s in instance.swarm.servers)
    assert paper_swarm(30, 0.3, seed=5, rtt=synthetic_rtt()) == instance


@pytest.mark.skipif(not RIPE.exists(), reason=f"RIPE Atlas data not found at {RIPE}")
def test_ripe_rtt_matrix_is_derived_symmetric_and_european_scale():
    rtt = load_ripe_rtt(RIPE)
    assert rtt.nodes == 320 and "derived" in rtt.source
    assert np.allclose(rtt.rtt_ms, rtt.rtt_ms.T) and np.all(np.diag(rtt.rtt_ms) == 0)
    off = rtt.rtt_ms[~np.eye(rtt.nodes, dtype=bool)]
    assert 1.0 < np.median(off) < 60.0


@pytest.mark.skipif(not AZURE_CONV.exists(), reason=f"Azure trace not found at {AZURE_CONV}")
def test_azure_trace_replays_scaled_to_a_rate_with_token_derived_sizes():
    trace = load_azure_trace(AZURE_CONV)
    assert len(trace) == 19366 and trace.seconds[0] == 0.0 and np.all(np.diff(trace.seconds) >= 0)
    workload = trace_workload(trace, jobs=5000, rate_per_ms=0.0002, sizes="trace", rng=np.random.default_rng(0))
    assert workload.rate_per_ms == pytest.approx(0.0002, rel=1e-9)
    assert workload.jobs == 5000 and np.all(workload.sizes > 0)
    assert workload.sizes.mean() == pytest.approx(1.0, rel=1e-12)  # normalized over the replayed requests
    native = trace_workload(trace, jobs=None, rate_per_ms=None, sizes="trace", rng=np.random.default_rng(0))
    assert native.sizes.mean() == pytest.approx(1.0) and native.rate_per_ms > 1 / 1000  # several requests per second


def test_trace_sizes_have_mean_one_over_the_replayed_prefix_not_the_whole_trace():
    # the first requests are short, the last ones long: over the whole trace the prefix would have mean well below 1
    context = np.array([100] * 50 + [4000] * 50)
    trace = Trace(np.arange(100, dtype=float), context, np.full(100, 50), "synthetic")
    prefix = trace_workload(trace, jobs=40, rate_per_ms=0.001, sizes="trace", rng=np.random.default_rng(0))
    assert prefix.sizes.mean() == pytest.approx(1.0, rel=1e-12)
    whole = trace_workload(trace, jobs=None, rate_per_ms=None, sizes="trace", rng=np.random.default_rng(0))
    assert whole.sizes.mean() == pytest.approx(1.0, rel=1e-12) and whole.sizes[0] < prefix.sizes[0]


def test_a_trace_scaled_to_other_mean_lengths_keeps_its_times_and_spread():
    trace = Trace(np.arange(4, dtype=float), np.array([100, 300, 0, 400]), np.array([10, 0, 30, 40]), "synthetic")
    scaled = with_mean_lengths(trace, 40.0, 400.0)  # prompts x 0.2, outputs x 20
    assert scaled.context_tokens.tolist() == [20, 60, 1, 80]  # at least one token each
    assert scaled.generated_tokens.tolist() == [200, 1, 600, 800]
    assert scaled.seconds is trace.seconds and "means of 40 and 400" in scaled.name
    with pytest.raises(ValueError):
        with_mean_lengths(trace, 0.0, 10.0)


def test_paired_comparison_calls_identical_runs_a_tie_and_consistent_gains_a_win():
    same = paired_comparison([7.7] * 20, [7.7] * 20)
    assert (same.verdict, same.equal, same.better, same.worse) == ("tie", 20, 0, 0)
    # the same chain summed in another server order: service times a few ulps apart are still identical runs
    ulps = paired_comparison([7789.861191840114] * 20, [7789.861191840113] * 10 + [7789.861191840115] * 10)
    assert (ulps.verdict, ulps.equal) == ("tie", 20)
    # 16 of 20 seeds better by 0.001, 4 worse by 0.001 is a win (p = 0.012 by the sign test); 12 of 20 is a tie
    mine = [7.0] * 20
    assert paired_comparison(mine, [7.001] * 16 + [6.999] * 4).verdict == "win"
    assert paired_comparison([7.001] * 16 + [6.999] * 4, mine).verdict == "loss"
    assert paired_comparison(mine, [7.001] * 12 + [6.999] * 8).verdict == "tie"


def test_fig8_compares_each_proposed_variant_with_the_baselines_only():
    result = fig8(servers=(10,), etas=(0.4,), seeds=2, jobs=120, warmup_jobs=10, policies=FIG8_POLICIES,
                  rtt_path=None, progress=False)
    cell = result["cells"][0]
    assert set(cell["reduction_vs_petals"]) == {"proposed", "proposed-spare"}
    for variant in ("proposed", "proposed-spare"):
        assert set(paired_verdicts(cell, variant)) == {"petals", "bprr", "parallax", "helix"}  # jffc-only: infeasible
    # four fast servers: Alg. 1 builds the very chain Parallax-style builds, so their runs are identical
    assert "tie vs parallax (identical in 2/2 seeds)" in non_wins(cell, "proposed")
    table = fig8_table(result)
    assert "non-wins: paper" in table and "non-wins: spare" in table


def fake_run(means_ms: dict[str, float | None]) -> dict:
    """Gives a `run_cell` output where each policy's jobs all took its given time, or it was infeasible (None)."""
    policies = {
        name: {"infeasible": f"{name} cannot run"} if mean is None
        else {"response_ms": np.full(3, mean), "waiting_ms": np.zeros(3), "service_ms": np.full(3, mean), "c": 2}
        for name, mean in means_ms.items()
    }
    return {"rtt_source": "fake", "policies": policies}


def test_fig8_pairs_policies_by_seed_when_they_fail_on_different_seeds():
    # seed s costs 100 (s + 1) for PETALS and 1 less for the proposed method: a win on every seed both ran. The
    # proposed method cannot run seed 0 and PETALS not seed 5: paired by position, proposed's seed 1 would meet
    # PETALS' seed 0 (and so on), a loss of about 99 on every pair.
    runs = [
        (seed, fake_run({"petals": None if seed == 5 else 100.0 * (seed + 1),
                         "proposed": None if seed == 0 else 100.0 * (seed + 1) - 1.0}))
        for seed in range(6)
    ]
    cell = fig8_cell(10, 0.1, runs, ("petals", "proposed"))
    assert cell["policies"]["proposed"]["mean_response_per_seed_ms"] == {s: 100.0 * (s + 1) - 1.0 for s in range(1, 6)}
    result = paired_comparisons(cell, "proposed")["petals"]
    assert (result.verdict, result.better, result.worse, result.equal) == ("win", 4, 0, 0)  # seeds 1..4
    assert result.mean_diff_ms == pytest.approx(1.0)
    assert non_wins(cell, "proposed") == []
    # the reduction too is over seeds 1..4 only: 1 - (1400 - 4) / 1400 (all six PETALS seeds would give 1 - 1396 / 1500)
    assert cell["reduction_vs_petals"]["proposed"] == pytest.approx(4 / 1400)


def test_fig8_per_seed_means_survive_a_json_round_trip_and_still_pair(tmp_path):
    runs = [(s, fake_run({"petals": 10.0 + s, "proposed": None if s == 1 else 9.0 + s})) for s in range(3)]
    cell = fig8_cell(10, 0.1, runs, ("petals", "proposed"))
    path = tmp_path / "cell.json"
    write_json(path, cell)
    loaded = json.loads(path.read_text())
    assert loaded["policies"]["proposed"]["mean_response_per_seed_ms"] == {"0": 9.0, "2": 11.0}
    assert paired_comparisons(loaded, "proposed")["petals"] == paired_comparisons(cell, "proposed")["petals"]


def test_fig8_rejects_an_unknown_policy_with_a_typed_error(capsys):
    code = swarm_sim(["fig8", "--policies", "petals,nonsense", "--seeds", "1", "--no-plot", "--no-progress"])
    assert code == 2
    assert "swarm-sim fig8: error: unknown policy nonsense" in capsys.readouterr().err


def test_shared_service_slows_jobs_by_the_batch_on_their_servers_and_speeds_them_up_as_others_end():
    """One server, one block, tau_p = 10 ms alone, +10 ms per other job: a job at t = 0, another at t = 5."""
    from orchestrator.sim.service import SharedService

    swarm = SwarmModel(ModelSpec(1, 1.0, 1.0), (ServerSpec("k", 10.0, 0.0, 10.0, 10.0),))
    route = Route(("k",), (1,), 10.0)
    clock = SharedService(swarm)
    clock.start(0, route, 1.0, 0.0)
    assert clock.next_end_ms() == pytest.approx(10.0)
    clock.start(1, route, 1.0, 5.0)  # job 0 is half done; both now take 20 ms each in all
    assert clock.finish() == (pytest.approx(15.0), 0)
    assert clock.finish() == (pytest.approx(20.0), 1)  # half done at 15, alone again at 10 ms in all
    assert clock.next_end_ms() == math.inf


def test_shared_service_makes_jobs_that_prefill_on_one_server_take_turns_and_lets_decodes_ride_along():
    """One server, one block, tau_p = 10 ms alone of which 4 ms prefill, no slope: two jobs at t = 0, a third at 9."""
    from orchestrator.sim.service import SharedService

    swarm = SwarmModel(ModelSpec(1, 1.0, 1.0), (ServerSpec("k", 10.0, 0.0, 10.0, 0.0, 4.0),))
    route = Route(("k",), (1,), 10.0)
    clock = SharedService(swarm)
    clock.start(0, route, 1.0, 0.0)
    clock.start(1, route, 1.0, 0.0, prompt=0.5)  # half the mean prompt: 2 ms of prefill alone, 8 of decode
    assert clock.finish() == (pytest.approx(4.0), None)  # job 1's prompt at half speed: a phase change, no end
    assert clock.finish() == (pytest.approx(6.0), None)  # job 0's: 2 ms done by 4, the last 2 alone
    clock.start(2, route, 1.0, 9.0)  # prefills alone while the other two decode: they do not slow it
    assert clock.finish() == (pytest.approx(12.0), 0)  # 6 + 6 (ties end in start order)
    assert clock.finish() == (pytest.approx(12.0), 1)  # 4 + 8
    assert clock.finish() == (pytest.approx(13.0), None)
    assert clock.finish() == (pytest.approx(19.0), 2)
    assert clock.next_end_ms() == math.inf


def test_the_simulator_ends_every_job_once_when_servers_share_prefills():
    model = ModelSpec(blocks=1, block_gb=1.0, cache_gb=1.0)
    swarm = SwarmModel(model, (ServerSpec("k", 6.0, 0.0, 10.0, 1.0, 4.0),))
    chains = [Chain(("k",), (1,), 5, 10.0)]
    workload = Workload(np.zeros(4), np.ones(4), "four at once", prompts=np.array([1.0, 0.0, 2.0, 1.0]))
    result = simulate(JFFCPolicy(chains, Placement({"k": (1, 1)})), workload, swarm)
    # prefills alone 4, 0, 8, 4 ms. Job 1 decodes from the start, alone: ends at 10. Jobs 0 and 3 prefill in thirds
    # (to 12), then decode 6 ms, beside each other (+1 ms) and from 16 beside job 2 too (+2 ms): 136/7. Job 2's
    # prompt ends at 16 (half of it in thirds by 12, the rest alone in 4 ms); its 2 ms of decode run beside
    # two (4 ms in all) until 136/7, then alone: 138/7.
    assert result.end_ms.tolist() == pytest.approx([136 / 7, 10.0, 138 / 7, 136 / 7])
    paper = simulate(JFFCPolicy(chains, Placement({"k": (1, 1)})), workload, swarm.paper_model())
    assert paper.end_ms.tolist() == pytest.approx([10.0] * 4)


def test_without_slopes_shared_service_ends_jobs_when_the_papers_fixed_service_does():
    from orchestrator.sim.service import FixedService, SharedService

    rng = np.random.default_rng(5)
    swarm, _, chains = one_block_chains([1.0, 0.5, 0.25], [3, 3, 3])
    shared, fixed = SharedService(swarm), FixedService()
    ends: dict[str, list[tuple[float, int]]] = {"shared": [], "fixed": []}
    arrivals = np.cumsum(rng.exponential(0.5, size=100))
    for job, now in enumerate(arrivals):
        while fixed.next_end_ms() <= now:  # jobs that end before this arrival end first, as in the engine
            ends["shared"].append(shared.finish())
            ends["fixed"].append(fixed.finish())
        route = Route.of_chain(chains[int(rng.integers(3))], 0)
        size = float(rng.exponential())
        for clock in (shared, fixed):
            clock.start(job, route, size, float(now))
    while fixed.next_end_ms() < math.inf:
        ends["shared"].append(shared.finish())
        ends["fixed"].append(fixed.finish())
    assert [j for _, j in ends["shared"]] == [j for _, j in ends["fixed"]]
    assert [t for t, _ in ends["shared"]] == pytest.approx([t for t, _ in ends["fixed"]])


def test_batched_servers_make_jffc_spread_jobs_and_the_simulator_slow_each_batch_down():
    """Two one-block servers: `fast` 10 ms alone but +8 ms per job it batches, `slow` 20 ms flat. Five jobs at once."""
    model = ModelSpec(blocks=1, block_gb=1.0, cache_gb=1.0)
    batched = SwarmModel(model, (ServerSpec("fast", 6.0, 0.0, 10.0, 8.0), ServerSpec("slow", 6.0, 0.0, 20.0)))
    placement = Placement({"fast": (1, 1), "slow": (1, 1)})
    chains = [Chain(("fast",), (1,), 5, 10.0), Chain(("slow",), (1,), 5, 20.0)]
    workload = Workload(np.zeros(5), np.ones(5), "five at once")
    aware = simulate(JFFCPolicy(chains, placement, swarm=batched), workload, batched)
    assert aware.chain_of.tolist() == [0, 0, 1, 1, 1]  # fast at 10, 18, then 26 against slow's flat 20
    blind = simulate(JFFCPolicy(chains, placement), workload, batched)
    assert blind.chain_of.tolist() == [0] * 5  # the paper's ranking fills the fast chain
    assert blind.end_ms.max() == pytest.approx(10.0 + 4 * 8.0)  # five in one batch: 42 ms each
    assert aware.end_ms.tolist() == pytest.approx([18.0, 18.0, 20.0, 20.0, 20.0])
    # swarm-sim's jffc-only: the policy ranks by the swarm it is given to see, the jobs run in the simulated one
    from orchestrator.sim.runner import run_policy

    seen = run_policy("jffc-only", batched, workload, 0.1, 0.7, 0, warmup_jobs=0)
    assert seen.chain_of.tolist() == [0, 0, 1, 1, 1]
    blind_run = run_policy("jffc-only", batched, workload, 0.1, 0.7, 0, warmup_jobs=0,
                           ranking=batched.with_batch_slopes({}))
    assert blind_run.chain_of.tolist() == [0] * 5 and blind_run.end_ms.max() == pytest.approx(42.0)
