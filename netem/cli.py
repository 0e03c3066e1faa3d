"""swarm-netem: emulate a wide-area network on this machine with network namespaces (needs root).

    swarm-netem up --topology T.json          # prints a run id
    swarm-netem exec RUN HOST -- cmd ...      # runs cmd inside HOST's namespace
    swarm-netem ping RUN [--json OUT.json]    # measured RTT matrix next to the target
    swarm-netem set RUN --topology T2.json    # new RTTs, bandwidths, loss for the running hosts
    swarm-netem down RUN                      # stops the run's processes, removes its namespaces and links
    swarm-netem list                          # runs that still have namespaces here
    swarm-netem topology ripe --hosts 5 --seed 0 -o T.json   # write a topology (also: uniform, geometric)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from netem import netns, ripe, topology
from netem.backends import BACKENDS
from netem.network import UNWIND_SIGNALS, EmulatedNetwork, down, raise_exit, state_dir
from netem.probe import measure_rtts


def cmd_up(args: argparse.Namespace) -> int:
    spec = topology.Topology.from_file(args.topology)
    network = EmulatedNetwork(spec, run_id=args.run_id, backend=args.backend, realtime=not args.no_realtime)
    # Interrupted set-up must not leave half a run behind: start() tears down what it made on any exception.
    for signum in UNWIND_SIGNALS:
        signal.signal(signum, raise_exit)
    network.start()
    assert network.backend is not None
    print(f"run {network.run_id} up: backend {network.backend.name}, {len(spec.hosts)} hosts", file=sys.stderr)
    for host in spec.hosts:
        print(f"  {host:<16} {network.address(host):<15} namespace {network.namespace(host)}", file=sys.stderr)
    if spec.source:
        print(f"  RTTs: {spec.source}", file=sys.stderr)
    print(f"  stop it with: swarm-netem down {network.run_id}", file=sys.stderr)
    print(network.run_id)
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("swarm-netem exec: give a command after --")
    network = EmulatedNetwork.attach(args.run)
    env = {**os.environ, **network.host_env(args.host)}
    argv = network.command(args.host, command)
    os.execvpe(argv[0], argv, env)  # replaces this process: the command's exit code is ours
    return 127  # pragma: no cover


def cmd_ping(args: argparse.Namespace) -> int:
    network = EmulatedNetwork.attach(args.run)
    measurement = measure_rtts(network, proto=args.proto, count=args.count)
    source = f" ({network.topology.source})" if network.topology.source else ""
    print(f"run {args.run}: {args.proto} echo, median of {args.count} per pair, RTTs{source}")
    print(measurement.table())
    failures = measurement.failures()
    print(f"{len(failures)} of {len(list(measurement.pairs()))} pairs outside 10% + 1 ms; {measurement.lost} lost")
    if args.json:
        Path(args.json).write_text(json.dumps(measurement.to_json(), indent=1, allow_nan=False))
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    network = EmulatedNetwork.attach(args.run)
    network.set_topology(topology.Topology.from_file(args.topology))
    print(f"run {args.run}: delays updated ({network.topology.source or args.topology})")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    for run_id in args.runs:
        removed = down(run_id)
        print(f"run {run_id}: removed {len(removed)} namespaces" if removed else f"run {run_id}: nothing left")
    return 0


def cmd_list(_args: argparse.Namespace) -> int:
    for run_id in netns.list_runs():
        state_file = state_dir(run_id) / "run.json"
        state = json.loads(state_file.read_text()) if state_file.is_file() else {}
        print(f"{run_id}  backend={state.get('backend')}  hosts={','.join(state.get('hosts', []))}")
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    if args.kind == "ripe":
        spec = ripe.from_ripe_atlas(args.hosts, seed=args.seed, path=args.data)
    elif args.kind == "uniform":
        spec = topology.uniform(args.hosts, min_ms=args.min_ms, max_ms=args.max_ms, seed=args.seed)
    else:
        spec = topology.random_geometric(args.hosts, min_ms=args.min_ms, max_ms=args.max_ms, seed=args.seed)
    text = spec.to_json()
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Gives the argument parser of swarm-netem."""
    parser = argparse.ArgumentParser(prog="swarm-netem", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    commands = parser.add_subparsers(dest="command_name", required=True)

    up = commands.add_parser("up", help="create a run from a topology file; prints its id")
    up.add_argument("--topology", required=True, help="topology .json or .csv")
    up.add_argument("--backend", choices=BACKENDS, default="auto", help="delay backend (default: tc if available)")
    up.add_argument("--run-id", help="run id to use (default: random)")
    up.add_argument("--no-realtime", action="store_true", help="run the fabric at normal priority")
    up.set_defaults(func=cmd_up)

    exec_ = commands.add_parser("exec", help="run a command inside a host's namespace")
    exec_.add_argument("run")
    exec_.add_argument("host")
    exec_.add_argument("command", nargs=argparse.REMAINDER, help="-- cmd args...")
    exec_.set_defaults(func=cmd_exec)

    ping = commands.add_parser("ping", help="measure every pair's RTT next to its target")
    ping.add_argument("run")
    ping.add_argument("--json", metavar="OUT", help="also write {hosts, target_ms, measured_ms} here")
    ping.add_argument("--count", type=int, default=20, help="echoes per pair (default: %(default)s)")
    ping.add_argument("--proto", choices=("udp", "tcp"), default="udp")
    ping.set_defaults(func=cmd_ping)

    set_ = commands.add_parser("set", help="change RTTs, bandwidths and loss of a running run (same hosts)")
    set_.add_argument("run")
    set_.add_argument("--topology", required=True, help="topology .json or .csv with the run's hosts")
    set_.set_defaults(func=cmd_set)

    down_ = commands.add_parser("down", help="stop a run's processes and remove its namespaces")
    down_.add_argument("runs", nargs="+", metavar="RUN")
    down_.set_defaults(func=cmd_down)

    list_ = commands.add_parser("list", help="runs that still have namespaces on this machine")
    list_.set_defaults(func=cmd_list)

    topo = commands.add_parser("topology", help="write a generated topology as JSON")
    topo.add_argument("kind", choices=("ripe", "uniform", "geometric"))
    topo.add_argument("--hosts", type=int, required=True)
    topo.add_argument("--seed", type=int, default=0)
    topo.add_argument("--min-ms", type=float, default=5.0, help="uniform/geometric: smallest RTT")
    topo.add_argument("--max-ms", type=float, default=80.0, help="uniform/geometric: largest RTT")
    topo.add_argument("--data", help="ripe: path of ripe_atlas_eu_rtt.csv (default: ../shared/data)")
    topo.add_argument("-o", "--output", help="file to write (default: stdout)")
    topo.set_defaults(func=cmd_topology)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the swarm-netem console script."""
    args = build_parser().parse_args(argv)
    problem = netns.support_problem() if args.command_name == "up" else None
    if problem:
        print(f"swarm-netem: {problem}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (RuntimeError, ValueError, KeyError, OSError) as error:
        print(f"swarm-netem: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
