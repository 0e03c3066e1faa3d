"""`swarm-sim`: plan a swarm's chains from a spec file and analyze chains' response times.

    swarm-sim compose SPEC.json [--c N | --method lower_bound|upper_bound|surrogate|overflow] [--spare-chains]
                      [--json OUT.json]
    swarm-sim analyze --arrival-rate 1 --rates 1,0.3 --capacities 2,3 [--json OUT.json]

Every subcommand prints a table and, with `--json PATH`, writes its results as JSON. Subcommands are registered
by the functions in SUBCOMMANDS: to add one, write `register(subparsers)` that adds a parser whose `run` default
takes the parsed arguments and gives an exit code, and append it there.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orchestrator.allocation import slot_use
from orchestrator.analysis import exact_mean_response, mean_response_bounds
from orchestrator.sim import cli as sim_cli
from orchestrator.spec import SwarmSpecError, load_swarm_spec
from orchestrator.swarm_model import per_ms
from orchestrator.tuning import TUNING_METHODS, TunedPlan, overflow_estimate_ms, plan_for_capacity, tune_capacity

Registrar = Callable[[Any], None]  # gets argparse's subparsers object


class CommandError(Exception):
    """A failure to report as `swarm-sim CMD: error: ...` with exit code 2."""


def finite_or_none(value: float) -> float | None:
    """Gives `value`, or None where JSON has no number for it (inf, nan)."""
    return value if math.isfinite(value) else None


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Writes `payload` as indented JSON (keys in the order built, so outputs are byte-for-byte reproducible)."""
    Path(path).write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _number_list(parse: Callable[[str], float | int]) -> Callable[[str], list]:
    def parse_list(text: str) -> list:
        try:
            return [parse(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None

    return parse_list


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


# ---- compose ---------------------------------------------------------------------------------------------------


def compose_payload(plan: TunedPlan, spec_arrival_rate: float, rho_bar: float, method: str, swarm: Any) -> dict:
    """Gives the JSON document of a composed plan (rates per second, times in ms)."""
    total_per_s = plan.total_rate_per_ms * 1000.0
    return {
        "c": plan.c,
        "method": method,
        "spare_chains": plan.spare_chains,
        "arrival_rate": spec_arrival_rate,
        "rho_bar": rho_bar,
        "placement": {name: [first, count] for name, (first, count) in plan.placement.blocks.items()},
        "chains": [
            {
                "servers": list(chain.servers),
                "blocks": list(chain.blocks_per_server),
                "capacity": chain.capacity,
                "service_time_ms": chain.service_time_ms,
            }
            for chain in plan.chains
        ],
        "total_rate": total_per_s,
        "load": spec_arrival_rate / total_per_s if total_per_s > 0 else None,
        "stable": plan.stable,
        "bounds": {"lower_ms": finite_or_none(plan.lower_ms), "upper_ms": finite_or_none(plan.upper_ms)},
        "overflow_estimate_ms": finite_or_none(overflow_estimate_ms(per_ms(spec_arrival_rate), plan.chains)),
        "slots": {
            name: {"total": use.total, "used": use.used, "free": use.free}
            for name, use in slot_use(swarm, plan.placement, plan.chains).items()
        },
    }


def run_compose(args: argparse.Namespace) -> int:
    if args.c is not None and args.method is not None:
        raise CommandError("--method tunes c, so it cannot be combined with a fixed --c; give one of them")
    try:
        spec = load_swarm_spec(args.spec)
    except SwarmSpecError as error:
        raise CommandError(str(error)) from None
    swarm = spec.swarm()
    try:
        if args.c is not None:
            plan = plan_for_capacity(swarm, args.c, spec.arrival_rate_per_ms, spec.rho_bar,
                                     spare_chains=args.spare_chains)
            method = "fixed"
        else:
            # spare chains mix fast and slow chains, where the lower bound misleads: tune them by the estimate
            method = args.method or ("overflow" if args.spare_chains else "lower_bound")
            plan = tune_capacity(swarm, spec.arrival_rate_per_ms, spec.rho_bar, method=method,
                                 spare_chains=args.spare_chains)
    except ValueError as error:
        raise CommandError(str(error)) from None
    payload = compose_payload(plan, spec.arrival_rate, spec.rho_bar, method, swarm)
    hosting = sum(1 for _, count in plan.placement.blocks.values() if count > 0)
    spare = ", spare chains" if plan.spare_chains else ""
    print(f"c = {plan.c} ({method}{spare}); {hosting} of {len(swarm.servers)} servers host blocks; "
          f"{len(plan.chains)} chains")
    print(f"{'chain':>5}  {'capacity':>8}  {'service ms':>11}  servers (blocks)")
    for index, chain in enumerate(plan.chains):
        hops = zip(chain.servers, chain.blocks_per_server, strict=True)
        route = " -> ".join(f"{name}({count})" for name, count in hops)
        print(f"{index:>5}  {chain.capacity:>8}  {chain.service_time_ms:>11.1f}  {route}")
    if plan.stable:
        print(f"total rate {payload['total_rate']:.4g}/s, load {payload['load']:.3f}; "
              f"mean response {plan.lower_ms:.1f} .. {plan.upper_ms:.1f} ms (Theorem 3.7 bounds)")
    if args.json:
        write_json(args.json, payload)  # an unstable plan is written too, to show why it cannot carry the load
    if not plan.stable:
        raise CommandError(f"unstable: arrival rate {spec.arrival_rate:g}/s >= total rate "
                           f"{payload['total_rate']:.4g}/s of the chains at c = {plan.c}")
    return 0


def register_compose(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compose", help="place blocks (GBP-CR) and compose chains (GCA) for a swarm spec",
        description="Runs GBP-CR with c tuned by Theorem 3.7's lower bound (or the given --c), then GCA. "
        "--spare-chains also stacks the servers GBP-CR leaves over into spare chains and then tunes c by the "
        "overflow estimate of JFFC's mean response. Exits 2 if the plan cannot carry the arrival rate (its "
        "table and JSON are still written).",
    )
    parser.add_argument("spec", type=Path, help="swarm spec JSON (see README)")
    parser.add_argument("--c", type=_positive_int, help="required capacity c for GBP-CR (default: tuned)")
    parser.add_argument("--method", choices=TUNING_METHODS, default=None,
                        help="how to tune c (default: lower_bound; overflow with --spare-chains); not with --c")
    parser.add_argument("--spare-chains", action="store_true",
                        help="place the servers left over at GBP-CR's stop into spare chains (not idle)")
    parser.add_argument("--json", type=Path, help="write the plan as JSON here")
    parser.set_defaults(run=run_compose)


# ---- analyze ---------------------------------------------------------------------------------------------------


def run_analyze(args: argparse.Namespace) -> int:
    if len(args.rates) != len(args.capacities):
        raise CommandError(f"{len(args.rates)} rates but {len(args.capacities)} capacities")
    try:
        lower, upper = mean_response_bounds(args.arrival_rate, args.rates, args.capacities)
    except ValueError as error:
        raise CommandError(str(error)) from None
    try:
        exact: float | None = exact_mean_response(args.arrival_rate, args.rates, args.capacities)
    except ValueError:
        exact = None  # too many occupancy states to solve exactly
    print(f"mean response time (unit of 1 / rate): lower {lower:.4f}  upper {upper:.4f}  "
          f"exact {'n/a (too many states)' if exact is None else f'{exact:.4f}'}")
    if args.json:
        write_json(args.json, {
            "arrival_rate": args.arrival_rate,
            "rates": args.rates,
            "capacities": args.capacities,
            "lower": lower,
            "upper": upper,
            "exact": exact,
        })
    return 0


def register_analyze(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "analyze", help="JFFC mean response time bounds (Theorem 3.7) and exact value for given chains",
        description="Mean response times under JFFC with Poisson arrivals and exponential service, in the time "
        "unit of 1 / rate. 'exact' solves the occupancy chain (always for two chains; more if small).",
    )
    parser.add_argument("--arrival-rate", type=float, required=True, help="jobs per unit time")
    parser.add_argument("--rates", type=_number_list(float), required=True, help="chain service rates, e.g. 1,0.3")
    parser.add_argument("--capacities", type=_number_list(int), required=True, help="chain capacities, e.g. 2,3")
    parser.add_argument("--json", type=Path, help="write lower, upper and exact as JSON here")
    parser.set_defaults(run=run_analyze)


# one line per subcommand; each adds its parser to the subparsers it is given
SUBCOMMANDS: list[Registrar] = [
    register_compose,
    register_analyze,
    sim_cli.register,  # run, fig3 ... fig8
]


def build_parser() -> argparse.ArgumentParser:
    """Gives the parser of swarm-sim with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="swarm-sim", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs swarm-sim and gives its exit code: 0 on success, 2 on a usage or input error."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CommandError as error:
        print(f"swarm-sim {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
