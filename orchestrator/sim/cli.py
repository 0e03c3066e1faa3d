"""`swarm-sim` simulation subcommands: the paper's Figs. 3-8 and `run` for any swarm, policy and workload.

    swarm-sim run [--spec SWARM.json|.yaml | --servers 20 --eta 0.2] [--policy proposed,petals,...] [--trace CSV]
    swarm-sim fig3 | fig4 | fig5 | fig6 | fig7 | fig8 [--quick] [--seeds N] [--jobs N] [--workers N]

Every subcommand prints tables, writes a PNG plot (`--plot PATH`, `--no-plot`) and, with `--json PATH`, its
results as JSON. Seeds fix everything: the same command gives the same JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from orchestrator.dispatch_policy import NoFeasiblePlan
from orchestrator.sim import experiments, plots
from orchestrator.sim.methods import FIG8_POLICIES, POLICIES, PROPOSED, compose
from orchestrator.sim.metrics import pooled_summary
from orchestrator.sim.overall import FIG8_ETAS, FIG8_SERVERS, cached_rtt, fig8, fig8_table
from orchestrator.sim.presets import DEFAULT_RATE_PER_S, DEFAULT_RHO_BAR, paper_swarm
from orchestrator.sim.report import SUMMARY_HEADERS, format_table, seconds, summary_row, write_json
from orchestrator.sim.runner import WORKLOAD_STREAM, map_tasks, run_policy, seeded_poisson
from orchestrator.sim.workload import SIZE_MODELS, load_azure_trace, trace_workload
from orchestrator.spec import SwarmSpecError, load_swarm_spec, parse_swarm_spec


class SimError(Exception):
    """Bad input to a simulation command, reported as `swarm-sim CMD: error: ...` with exit code 2."""


def _list(parse):
    def convert(text: str) -> list:
        try:
            return [parse(part) for part in text.split(",") if part]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}") from None

    return convert


def load_swarm_file(path: str | Path):
    """Gives the validated swarm spec in a JSON or YAML file (YAML: same fields as the JSON spec)."""
    path = Path(path)
    if path.suffix.lower() not in (".yaml", ".yml"):
        return load_swarm_spec(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise SwarmSpecError(f"cannot read YAML swarm spec {path}: {error}") from None
    return parse_swarm_spec(data, source=str(path))


def _common(parser: argparse.ArgumentParser, *, seeds: int, jobs: int) -> None:
    parser.add_argument("--servers", type=int, default=20, help="J, servers of the Sec. 4.1 preset (default 20)")
    parser.add_argument("--eta", type=float, default=0.2, help="share of high-performance servers (default 0.2)")
    parser.add_argument("--arrival-rate", type=float, default=DEFAULT_RATE_PER_S, help="jobs per second (0.2)")
    parser.add_argument("--rho-bar", type=float, default=DEFAULT_RHO_BAR, help="target maximum load (0.7)")
    parser.add_argument("--seeds", type=int, default=seeds, help=f"seeds (runs) to average (default {seeds})")
    parser.add_argument("--jobs", type=int, default=jobs, help=f"jobs per run (default {jobs})")
    parser.add_argument("--warmup", type=int, default=None, help="jobs not measured at the start (default 10%%)")
    parser.add_argument("--rtt", default=None, help="RIPE Atlas CSV (default ../shared/data; synthetic if missing)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--json", dest="json_path", default=None, help="write results as JSON here")
    parser.add_argument("--plot", default=None, help="PNG path (default swarm-sim-COMMAND.png)")
    parser.add_argument("--no-plot", action="store_true", help="do not write a PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _setting(args) -> experiments.Setting:
    if args.jobs < 2 or args.seeds < 1 or args.servers < 1:
        raise SimError("--jobs must be >= 2, --seeds and --servers >= 1")
    warmup = args.jobs // 10 if args.warmup is None else args.warmup
    return experiments.Setting(args.servers, args.eta, args.arrival_rate / 1000.0, args.rho_bar, args.jobs, warmup,
                               args.rtt)


def _finish(args, command: str, payload: dict, plot) -> int:
    payload["rtt_source"] = payload.get("rtt_source") or cached_rtt(args.rtt).source
    print(f"tau_c: {payload['rtt_source']}")
    if not args.no_plot:
        path = args.plot or f"swarm-sim-{command}.png"
        plot(payload, path)
        print(f"plot: {path}")
    if args.json_path:
        write_json(args.json_path, payload)
        print(f"json: {args.json_path}")
    return 0


def run_fig3(args) -> int:
    result = experiments.fig3(_setting(args), seed=args.first_seed, capacities=tuple(args.capacities),
                              samples=args.samples)
    for case, rows in result["cases"].items():
        print(f"\nFig. 3 ({case} memory): objective c K(c) / lambda (s), GBP-CR vs {args.samples} random placements")
        table = [[r["c"], seconds(r["gbp_cr_ms"]), seconds(r["random_best_ms"]),
                  seconds(float(np.median(r["random_ms"])) if len(r["random_ms"]) else float("nan")),
                  r["random_infeasible"], "yes" if r["gbp_cr_at_most_best_random"] else "NO"] for r in rows]
        headers = ["c", "GBP-CR", "random best", "random median", "random infeasible", "GBP-CR <= best"]
        print(format_table(headers, table))
    return _finish(args, "fig3", result, plots.plot_fig3)


def run_fig4(args) -> int:
    result = experiments.fig4(_setting(args), seed=args.first_seed)
    rows = [[r["rate_per_s"], r.get("c", "-"), r.get("gca", "infeasible"), r.get("gbp_cr_disjoint", "-"),
             r.get("optimal_ilp", "-"), r.get("lower_bound", "-")] for r in result["rows"]]
    print("Fig. 4: job servers needed for rate lambda / rho_bar under GBP-CR's placement (fewer is better)")
    print(format_table(["lambda /s", "c", "GCA", "GBP-CR chains", "optimal ILP", "lower bound"], rows))
    return _finish(args, "fig4", result, plots.plot_fig4)


def run_fig5(args) -> int:
    result = experiments.fig5(_setting(args), seeds=args.seeds, workers=args.workers, progress=not args.no_progress)
    names = list(result["rows"][0]["policies"])
    rows = [[f"{r['load']:.1f}", *(seconds(r["policies"][n]["response_ms"]) for n in names), seconds(r["lower_ms"]),
             seconds(r["upper_ms"]), seconds(r["policies"]["jffc"]["waiting_ms"]),
             seconds(r["policies"]["jffc"]["service_ms"]), f"{100 * r['jffc_service_share']:.0f}%"]
            for r in result["rows"]]
    print("Fig. 5: mean response (s) over fixed GBP-CR + GCA chains vs load factor lambda / nu")
    print(format_table(["load", *names, "lower", "upper", "JFFC wait", "JFFC service", "service share"], rows))
    return _finish(args, "fig5", result, plots.plot_fig5)


def run_fig6(args) -> int:
    result = experiments.fig6(_setting(args), seeds=args.seeds, capacities=tuple(range(1, args.max_c + 1)),
                              workers=args.workers, progress=not args.no_progress)
    keys = ("simulated_ms", "surrogate_ms", "lower_ms", "upper_ms")
    rows = [[r["c"], *(seconds(r[key]) for key in keys)] for r in result["rows"]]
    print("Fig. 6: mean response (s) vs c (inf/- where the chains cannot carry lambda)")
    print(format_table(["c", "simulated JFFC", "c K(c) / lambda", "lower", "upper"], rows))
    print("best c:", ", ".join(f"{k.removesuffix('_ms')} {v}" for k, v in result["best_c"].items()))
    return _finish(args, "fig6", result, plots.plot_fig6)


def run_fig7(args) -> int:
    result = experiments.fig7(_setting(args), seeds=args.seeds, capacities=tuple(range(1, args.max_c + 1)),
                              workers=args.workers, progress=not args.no_progress)
    keys = ("simulated", "lower", "upper", "surrogate")
    rows = [[r["rate_per_s"], *(f"{r[k]['mean']:.1f} {r[k]['per_seed']}" for k in keys)] for r in result["rows"]]
    print("Fig. 7: best c per arrival rate (mean over seeds, per seed)")
    print(format_table(["lambda /s", *keys], rows))
    return _finish(args, "fig7", result, plots.plot_fig7)


def run_fig8(args) -> int:
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown or not args.policies:
        raise SimError(f"unknown policy {', '.join(unknown) or '(none given)'}; choose from {', '.join(POLICIES)}")
    seeds, jobs = (5, 500) if args.quick else (args.seeds, args.jobs)
    warmup = jobs // 10 if args.warmup is None else args.warmup
    result = fig8(servers=tuple(args.servers_grid), etas=tuple(args.eta_grid), seeds=seeds,
                  policies=tuple(args.policies), jobs=jobs, warmup_jobs=warmup,
                  rate_per_ms=args.arrival_rate / 1000.0, rho_bar=args.rho_bar, rtt_path=args.rtt,
                  workers=args.workers, progress=not args.no_progress)
    print(f"Fig. 8: mean response time (s), {seeds} seeds x {jobs} jobs per cell; 'non-wins' per proposed variant "
          "(paper: Alg. 1 as published; spare: with spare chains) are paired over seeds")
    print(fig8_table(result))
    print("\nall cells pooled (per job):")
    rows = [summary_row(n, s, "" if s else "infeasible in every cell") for n, s in result["overall"].items()]
    print(format_table(SUMMARY_HEADERS, rows))
    return _finish(args, "fig8", result, plots.plot_fig8)


def _run_seed(task: tuple) -> dict:
    args, seed = task
    if args.spec:
        spec = load_swarm_file(args.spec)
        swarm, rate, rho_bar, source = spec.swarm(), spec.arrival_rate_per_ms, spec.rho_bar, f"spec {args.spec}"
    else:
        instance = paper_swarm(args.servers, args.eta, seed, cached_rtt(args.rtt))
        swarm, rate, rho_bar, source = instance.swarm, args.arrival_rate / 1000.0, args.rho_bar, instance.rtt_source
    if args.arrival_rate_given:
        rate = args.arrival_rate / 1000.0
    rho_bar = args.rho_bar if args.rho_bar_given else rho_bar
    warmup = args.jobs // 10 if args.warmup is None else args.warmup
    if args.trace:
        trace = load_azure_trace(args.trace)
        workload = trace_workload(trace, jobs=args.jobs, rate_per_ms=None if args.trace_native_rate else rate,
                                  sizes=args.sizes or "trace", rng=np.random.default_rng([seed, WORKLOAD_STREAM]))
    else:
        workload = seeded_poisson(rate, args.jobs, seed)
    out = {"seed": seed, "source": source, "workload": workload.description, "policies": {}}
    for name in args.policy:
        result = run_policy(name, swarm, workload, rate, rho_bar, seed, warmup_jobs=warmup, capacity=args.c)
        if isinstance(result, NoFeasiblePlan):
            out["policies"][name] = {"infeasible": str(result)}
            continue
        entry = {"summary": result.summary(), "response_ms": result.response_ms, "waiting_ms": result.waiting_ms,
                 "service_ms": result.service_ms}
        if name in PROPOSED or (args.c is None and name in ("jffc", "jsq", "jiq", "sed", "sa-jsq")):
            entry["c"] = compose(swarm, rate, rho_bar, args.c, name if name in PROPOSED else "proposed").capacity
        out["policies"][name] = entry
    return out


def run_run(args) -> int:
    if args.jobs < 2:
        raise SimError("--jobs must be >= 2")
    if args.sizes == "trace" and not args.trace:
        raise SimError("--sizes trace needs --trace")
    unknown = [p for p in args.policy if p not in POLICIES]
    if unknown:
        raise SimError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    args.arrival_rate_given = args.arrival_rate is not None
    args.rho_bar_given = args.rho_bar is not None
    args.arrival_rate = DEFAULT_RATE_PER_S if args.arrival_rate is None else args.arrival_rate
    args.rho_bar = DEFAULT_RHO_BAR if args.rho_bar is None else args.rho_bar
    options = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "run"})  # picklable for workers
    try:
        runs = map_tasks(_run_seed, [(options, args.seed + s) for s in range(args.seeds)], workers=args.workers,
                         description="run", progress=not args.no_progress)
    except (SwarmSpecError, OSError, ValueError) as error:
        raise SimError(str(error)) from None
    print(f"swarm: {runs[0]['source']}; workload: {runs[0]['workload']}; {args.seeds} seed(s)")
    payload: dict[str, Any] = {"command": "run", "seeds": [r["seed"] for r in runs], "source": runs[0]["source"],
                               "workload": runs[0]["workload"], "policies": {}}
    rows, responses = [], {}
    for name in args.policy:
        entries = [r["policies"][name] for r in runs]
        ok = [e for e in entries if "infeasible" not in e]
        if not ok:
            rows.append(summary_row(name, None, entries[0]["infeasible"]))
            payload["policies"][name] = {"infeasible": entries[0]["infeasible"]}
            continue
        pooled = pooled_summary_from(ok)
        note = f"c = {ok[0]['c']}" if "c" in ok[0] else ""
        rows.append(summary_row(name, pooled, note))
        responses[name] = np.concatenate([e["response_ms"] for e in ok])
        payload["policies"][name] = {"pooled": pooled, "runs": [e["summary"] for e in ok],
                                     **({"c": [e["c"] for e in ok]} if "c" in ok[0] else {})}
    print(format_table(SUMMARY_HEADERS, rows))
    for name in args.policy:
        entry = runs[0]["policies"][name]
        if "summary" in entry and entry["summary"]["chains"]:
            chain_rows = [[c["chain"], " > ".join(c["servers"]), c["capacity"], seconds(c["service_time_ms"]),
                           c["jobs"], f"{100 * c['utilization']:.1f}%"] for c in entry["summary"]["chains"]]
            print(f"\n{name}: chains of seed {runs[0]['seed']}")
            print(format_table(["chain", "servers", "capacity", "T s", "jobs", "utilization"], chain_rows))
    if not responses:
        print("no policy could run on this swarm")
    if not args.no_plot and responses:
        path = args.plot or "swarm-sim-run.png"
        plots.plot_run({}, responses, path)
        print(f"plot: {path}")
    if args.json_path:
        write_json(args.json_path, payload)
        print(f"json: {args.json_path}")
    return 0


def pooled_summary_from(entries: list[dict]) -> dict:
    """Gives pooled stats of several runs' per-job arrays (the `run` command's entries)."""

    class _Run:  # the three arrays pooled_summary reads
        def __init__(self, entry: dict) -> None:
            self.response_ms, self.waiting_ms, self.service_ms = (entry[k] for k in ("response_ms", "waiting_ms",
                                                                                    "service_ms"))

    return pooled_summary([_Run(e) for e in entries])


def _guarded(function):
    def run(args) -> int:
        try:
            return function(args)
        except (SimError, SwarmSpecError) as error:
            print(f"swarm-sim {args.command}: error: {error}", file=sys.stderr)
            return 2

    return run


def register(subparsers: Any) -> None:
    """Adds run and fig3..fig8 to swarm-sim's subcommands."""
    parser = subparsers.add_parser("run", help="simulate policies on a swarm (spec file or Sec. 4.1 preset)")
    parser.add_argument("--spec", default=None, help="swarm spec JSON or YAML (default: the Sec. 4.1 preset)")
    parser.add_argument("--servers", type=int, default=20, help="J of the preset (default 20)")
    parser.add_argument("--eta", type=float, default=0.2, help="share of high-performance servers (default 0.2)")
    parser.add_argument("--policy", type=_list(str), default=list(FIG8_POLICIES),
                        help=f"comma-separated, from {', '.join(POLICIES)} (default: the Fig. 8 set)")
    parser.add_argument("--arrival-rate", type=float, default=None, help="jobs/s (default: the spec's, or 0.2)")
    parser.add_argument("--rho-bar", type=float, default=None, help="target maximum load (default: spec's, or 0.7)")
    parser.add_argument("--c", type=int, default=None, help="fixed required capacity c instead of tuning it")
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per run (default 2000)")
    parser.add_argument("--warmup", type=int, default=None, help="jobs not measured at the start (default 10%%)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seeds", type=int, default=1, help="runs with seeds seed, seed+1, ... (default 1)")
    parser.add_argument("--trace", default=None, help="Azure LLM trace CSV for arrivals (and sizes)")
    parser.add_argument("--sizes", choices=SIZE_MODELS, default=None, help="job sizes (default: trace with --trace)")
    parser.add_argument("--trace-native-rate", action="store_true", help="replay the trace at its own rate")
    parser.add_argument("--rtt", default=None, help="RIPE Atlas CSV (default ../shared/data; synthetic if missing)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--json", dest="json_path", default=None, help="write results as JSON here")
    parser.add_argument("--plot", default=None, help="PNG of response CDFs (default swarm-sim-run.png)")
    parser.add_argument("--no-plot", action="store_true", help="do not write a PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=_guarded(run_run))

    for command, function, seeds, jobs, text in (
        ("fig3", run_fig3, 1, 2000, "GBP-CR vs random placements (objective of (10))"),
        ("fig4", run_fig4, 1, 2000, "job servers needed: GCA vs GBP-CR chains, lower bound, optimal ILP"),
        ("fig5", run_fig5, 5, 2000, "JFFC vs JSQ/JIQ/SED/SA-JSQ and the Theorem 3.7 bounds"),
        ("fig6", run_fig6, 5, 2000, "the impact of c: simulation, surrogate and bounds"),
        ("fig7", run_fig7, 3, 1000, "the best c vs arrival rate"),
        ("fig8", run_fig8, 20, 1000, "overall comparison over J x eta (PETALS, BPRR, Parallax, Helix, ...)"),
    ):
        parser = subparsers.add_parser(command, help=text)
        _common(parser, seeds=seeds, jobs=jobs)
        parser.add_argument("--first-seed", type=int, default=0, help="seed of the swarm (fig3, fig4)")
        if command == "fig3":
            parser.add_argument("--samples", type=int, default=500, help="random placements per c (default 500)")
            parser.add_argument("--capacities", type=_list(int), default=[1, 2, 4, 6, 8, 12, 16], help="c values")
            parser.set_defaults(arrival_rate=0.5)  # at 0.2/s one chain meets the rate for most c: nothing to compare
        if command == "fig5":
            parser.set_defaults(arrival_rate=1.0)  # chains composed for 1/s: several chains of different speeds
        if command in ("fig6", "fig7"):
            parser.add_argument("--max-c", type=int, default=30, help="largest c swept (default 30)")
        if command == "fig8":
            parser.add_argument("--servers-grid", type=_list(int), default=list(FIG8_SERVERS), help="J values")
            parser.add_argument("--eta-grid", type=_list(float), default=list(FIG8_ETAS), help="eta values")
            parser.add_argument("--policies", type=_list(str), default=list(FIG8_POLICIES), help="policies compared")
            parser.add_argument("--quick", action="store_true", help="5 seeds x 500 jobs")
        parser.set_defaults(run=_guarded(function))


def main(argv=None) -> int:
    """Runs only the simulation subcommands (swarm-sim has them all)."""
    parser = argparse.ArgumentParser(prog="swarm-sim")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return args.run(args)
