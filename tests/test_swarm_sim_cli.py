"""`swarm-sim compose` and `swarm-sim analyze` through their entry points, JSON outputs and input errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.analysis import exact_mean_response
from orchestrator.cli import main
from orchestrator.spec import load_swarm_spec
from orchestrator.tuning import tune_capacity

# the worked example of tests/test_allocation.py as a spec; 100 jobs/s at rho_bar 1 make GBP-CR use every server
WORKED_SPEC = {
    "model": {"blocks": 3, "block_gb": 8, "cache_gb": 1},
    "servers": [
        {"name": "A", "memory_gb": 26, "tau_c_ms": 10, "tau_p_ms": 10},
        {"name": "B", "memory_gb": 31, "tau_c_ms": 10, "tau_p_ms": 10},
        {"name": "C", "memory_gb": 18, "tau_c_ms": 10, "tau_p_ms": 20},
        {"name": "D", "memory_gb": 18, "tau_c_ms": 10, "tau_p_ms": 20},
        {"name": "E", "memory_gb": 18, "tau_c_ms": 10, "tau_p_ms": 20},
    ],
    "arrival_rate": 100,
    "rho_bar": 1.0,
}


def swarm_sim_command() -> list[str]:
    """Gives the installed console script, or the module when the venv has not installed it."""
    script = Path(sys.executable).parent / "swarm-sim"
    return [str(script)] if script.exists() else [sys.executable, "-m", "orchestrator.cli"]


def write_spec(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "swarm.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return path


def test_compose_with_fixed_c_writes_placement_chains_and_bounds(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, WORKED_SPEC)
    out = tmp_path / "plan.json"
    assert main(["compose", str(spec), "--c", "5", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["c"] == 5 and plan["method"] == "fixed"
    assert plan["placement"] == {"A": [1, 2], "B": [2, 2], "C": [1, 1], "D": [2, 1], "E": [3, 1]}
    assert [(c["servers"], c["capacity"], c["service_time_ms"]) for c in plan["chains"]] == [
        (["A", "B"], 5, 50.0), (["C", "B"], 5, 60.0), (["C", "D", "E"], 5, 90.0),
    ]
    assert plan["slots"]["D"] == {"total": 10, "used": 5, "free": 5}
    bounds = plan["bounds"]
    assert plan["stable"] and 50.0 <= bounds["lower_ms"] <= bounds["upper_ms"]
    again = tmp_path / "again.json"
    assert main(["compose", str(spec), "--c", "5", "--json", str(again)]) == 0
    assert again.read_bytes() == out.read_bytes()  # deterministic, byte for byte


def test_compose_tunes_c_by_the_lower_bound_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, WORKED_SPEC)
    out = tmp_path / "plan.json"
    assert main(["compose", str(spec), "--json", str(out)]) == 0
    loaded = load_swarm_spec(spec)
    expected = tune_capacity(loaded.swarm(), loaded.arrival_rate_per_ms, loaded.rho_bar)
    plan = json.loads(out.read_text())
    assert plan["c"] == expected.c and plan["method"] == "lower_bound"
    assert plan["bounds"] == {"lower_ms": expected.lower_ms, "upper_ms": expected.upper_ms}
    assert len(plan["chains"]) == len(expected.chains)
    assert f"c = {expected.c} (lower_bound)" in capsys.readouterr().out


def test_compose_with_spare_chains_places_the_servers_alg1_leaves_idle(tmp_path: Path) -> None:
    # 50 jobs/s at c = 5: GBP-CR's first chain (A, B) of rate 1/60 per ms meets 0.05 / 5, so Alg. 1 stops there
    spec = write_spec(tmp_path, dict(WORKED_SPEC, arrival_rate=50))
    paper, spare = tmp_path / "paper.json", tmp_path / "spare.json"
    assert main(["compose", str(spec), "--c", "5", "--json", str(paper)]) == 0
    assert main(["compose", str(spec), "--c", "5", "--spare-chains", "--json", str(spare)]) == 0
    paper_plan, spare_plan = json.loads(paper.read_text()), json.loads(spare.read_text())
    assert paper_plan["spare_chains"] is False and spare_plan["spare_chains"] is True
    assert paper_plan["placement"] == {"A": [1, 2], "B": [2, 2], "C": [0, 0], "D": [0, 0], "E": [0, 0]}
    assert spare_plan["placement"] == {"A": [1, 2], "B": [2, 2], "C": [1, 1], "D": [2, 1], "E": [3, 1]}
    assert [c["servers"] for c in spare_plan["chains"]] == [["A", "B"], ["C", "B"], ["C", "D", "E"]]
    assert all(use["free"] >= 0 for use in spare_plan["slots"].values())
    # the estimate is 50.697 ms against JFFC's exact 50.707 ms, in bounds 50.22 .. 85.37 ms
    rates, capacities = [1 / c["service_time_ms"] for c in spare_plan["chains"]], [5, 5, 5]
    exact = exact_mean_response(0.05, rates, capacities)
    assert spare_plan["overflow_estimate_ms"] == pytest.approx(exact, rel=1e-3)
    tuned = tmp_path / "tuned.json"
    assert main(["compose", str(spec), "--spare-chains", "--json", str(tuned)]) == 0
    assert json.loads(tuned.read_text())["method"] == "overflow"  # the default tuning with spare chains


def test_compose_fails_on_an_unstable_fixed_c_and_still_writes_the_plan_with_null_bounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = dict(WORKED_SPEC, arrival_rate=1000)  # 1 job per ms: more than any c can serve here
    out = tmp_path / "plan.json"
    assert main(["compose", str(write_spec(tmp_path, spec)), "--c", "5", "--json", str(out)]) == 2
    assert "swarm-sim compose: error: unstable: arrival rate 1000/s >= total rate" in capsys.readouterr().err
    plan = json.loads(out.read_text())
    assert plan["stable"] is False and plan["bounds"] == {"lower_ms": None, "upper_ms": None}
    assert main(["compose", str(write_spec(tmp_path, spec))]) == 2  # and tuning finds no stable c
    assert "lambda >= nu for every c" in capsys.readouterr().err


def test_compose_surrogate_skips_a_c_whose_gca_chains_are_unstable(tmp_path: Path) -> None:
    # c K(c) is smallest at c = 3, but GCA's chains there carry 23.6 of the 25.7 jobs/s; c = 6 ties and carries them
    spec = {
        "model": {"blocks": 5, "block_gb": 2, "cache_gb": 0.5},
        "servers": [
            {"name": name, "memory_gb": memory, "tau_c_ms": tau_c, "tau_p_ms": tau_p}
            for name, memory, tau_c, tau_p in [("s0", 5, 80, 21), ("s1", 18, 22, 40), ("s2", 14, 8, 34),
                                               ("s3", 9, 43, 22)]
        ],
        "arrival_rate": 25.7,
        "rho_bar": 1.0,
    }
    out = tmp_path / "plan.json"
    assert main(["compose", str(write_spec(tmp_path, spec)), "--method", "surrogate", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["c"] == 6 and plan["stable"] is True and plan["load"] < 1


def test_compose_rejects_a_tuning_method_with_a_fixed_c(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, WORKED_SPEC)
    assert main(["compose", str(spec), "--c", "5", "--method", "overflow"]) == 2
    assert "--method tunes c, so it cannot be combined with a fixed --c" in capsys.readouterr().err


def test_compose_names_the_bad_field_of_an_invalid_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = dict(WORKED_SPEC, servers=[dict(WORKED_SPEC["servers"][0], memory_gb=-1, gpu="a100")])
    assert main(["compose", str(write_spec(tmp_path, bad))]) == 2
    error = capsys.readouterr().err
    assert "servers[0].memory_gb: Input should be greater than or equal to 0" in error
    assert "servers[0].gpu: Extra inputs are not permitted" in error
    (tmp_path / "broken.json").write_text("{\"model\": ", encoding="utf-8")
    assert main(["compose", str(tmp_path / "broken.json")]) == 2
    assert "is not JSON" in capsys.readouterr().err
    assert main(["compose", str(tmp_path / "missing.json")]) == 2
    assert "cannot read swarm spec" in capsys.readouterr().err
    too_much = dict(WORKED_SPEC, servers=[dict(WORKED_SPEC["servers"][0], tau_p_prefill_ms=11)])
    assert main(["compose", str(write_spec(tmp_path, too_much))]) == 2
    assert "servers[0]: Value error, tau_p_prefill_ms 11.0 exceeds tau_p_ms 10.0" in capsys.readouterr().err
    shared = dict(WORKED_SPEC, servers=[dict(WORKED_SPEC["servers"][0], tau_p_prefill_ms=4, tau_p_batch_ms=1)])
    server = load_swarm_spec(write_spec(tmp_path, shared)).swarm().servers[0]
    assert (server.tau_p_prefill_ms, server.tau_p_batch_ms) == (4.0, 1.0)


def test_analyze_through_the_console_script(tmp_path: Path) -> None:
    out = tmp_path / "analysis.json"
    command = [*swarm_sim_command(), "analyze", "--arrival-rate", "1", "--rates", "1,0.3", "--capacities", "2,3",
               "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert (round(result["lower"], 3), round(result["exact"], 3), round(result["upper"], 3)) == (1.135, 1.456, 2.636)
    assert "lower 1.1353" in done.stdout


def test_analyze_rejects_unstable_or_mismatched_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "--arrival-rate", "3", "--rates", "1,0.3", "--capacities", "2,3"]) == 2
    assert "unstable" in capsys.readouterr().err
    assert main(["analyze", "--arrival-rate", "1", "--rates", "1,0.3", "--capacities", "2"]) == 2
    assert "2 rates but 1 capacities" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["analyze", "--arrival-rate", "1", "--rates", "1,x", "--capacities", "2,3"])
