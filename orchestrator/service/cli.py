"""`swarm-orchestrator`: place blocks on the servers that follow it and dispatch sessions by JFFC, until SIGTERM.

    swarm-orchestrator --model NAME --initial-peers ADDR... [--host H --port P --identity PATH] [--variant ...]
    swarm-orchestrator plan --model NAME --initial-peers ADDR... [--json PATH]

`plan` asks the model's active orchestrator for its live state and prints it as a table (and writes it as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from orchestrator.service.metrics import OrchestratorMetrics
from orchestrator.service.orchestrator import VARIANTS, Orchestrator, OrchestratorConfig
from swarm.dht import lookup_orchestrators_async
from swarm.dht_limits import MAX_RECORD_TTL_S
from swarm.errors import SwarmError
from swarm.metrics import serve_metrics
from swarm.model import DEFAULT_MODEL, ModelNotFound, resolve_model
from swarm.records import active_orchestrator
from swarm.rpc import dial
from swarm.signing import open_dht

log = logging.getLogger("swarm-orchestrator")


def build_parser() -> argparse.ArgumentParser:
    """Gives the parser of the service (the `plan` subcommand has its own, `build_plan_parser`)."""
    parser = argparse.ArgumentParser(prog="swarm-orchestrator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="hub-style name, checkpoint folder or .gguf file")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of any peers already in the swarm")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="TCP port to listen on, 0 = any")
    parser.add_argument("--announce-maddrs", nargs="*", default=[], help="multiaddrs others should dial (NAT, proxy)")
    parser.add_argument("--identity", type=Path, help="private key file for a stable peer id (created if missing)")
    parser.add_argument("--variant", choices=VARIANTS, default="proposed-spare",
                        help="proposed: the paper's GBP-CR with c tuned by the lower bound; proposed-spare: spare "
                        "chains from the servers GBP-CR leaves over, c by the overflow estimate; jffc-only: the "
                        "paper's baseline, the whole model on every server that fits it")
    parser.add_argument("--rho-bar", type=float, default=0.7, help="GBP-CR's target load per chain")
    parser.add_argument("--prior-rate", type=float, default=0.2, help="jobs/s assumed until 5 sessions arrived")
    parser.add_argument("--prior-prompt-tokens", type=float, default=128.0, help="mean prompt assumed at first")
    parser.add_argument("--prior-output-tokens", type=float, default=128.0, help="mean output assumed at first")
    parser.add_argument("--rate-window", type=float, default=60.0, help="seconds of arrivals the rate counts")
    parser.add_argument("--cache-tokens", type=int, help="KV tokens a job is planned to hold in each block (default: "
                        "the observed mean job's prompt + output; the paper reserves the maximum length, 2048)")
    parser.add_argument("--refresh-period", type=float, default=5.0, help="seconds between reading the swarm")
    parser.add_argument("--announce-period", type=float, default=10.0, help="seconds between DHT announcements")
    parser.add_argument("--record-ttl", type=float, default=30.0, help="seconds the record lives unless refreshed")
    parser.add_argument("--lease-ttl", type=float, default=30.0, help="seconds a lease lives unless renewed")
    parser.add_argument("--kv-packing", choices=("mell", "bf", "wf", "lb"),
                        help="pack the sessions of followers that host the same blocks onto as few of them as the "
                             "policy keeps, moving them live (JFFC's leases follow)")
    parser.add_argument("--packing-epoch", type=float, default=1.0, help="seconds between two packings")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port, printed)")
    parser.add_argument("--kv-dropping", action="store_true",
                        help="when the KV demand of followers that host the same blocks (their sessions and the "
                        "queue's) outgrows their pages, merge them into buddy groups that drop parameters to hold "
                        "more KV, and restore once it fits (KunServe); JFFC's chains follow the ranges")
    parser.add_argument("--drop-period", type=float, default=0.5, help="seconds between two looks at the demand")
    parser.add_argument("--restore-after", type=float, default=10.0,
                        help="seconds a drop lasts at least before its blocks may be restored")
    parser.add_argument("--restore-calm", type=float, default=15.0,
                        help="seconds the demand must have stayed within 80%% of the pages the servers would have "
                        "for KV with every block back before a restore (a lull between two waves of one burst does "
                        "not restore)")
    parser.add_argument("--batch-aware", action=argparse.BooleanOptionalAction, default=True,
                        help="JFFC ranks chains by their service time at the batches their servers run now, from "
                        "the decode times by batch size the servers announce (--no-batch-aware: the paper's ranking "
                        "by the time of a job alone)")
    parser.add_argument("--log-level", default="INFO")
    return parser


def build_plan_parser() -> argparse.ArgumentParser:
    """Gives the parser of `swarm-orchestrator plan`."""
    parser = argparse.ArgumentParser(prog="swarm-orchestrator plan",
                                     description="print the live plan of a model's active orchestrator")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="hub-style name, checkpoint folder or .gguf file")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of any peers in the swarm")
    parser.add_argument("--json", type=Path, help="also write the state as JSON to this file")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to find and ask the orchestrator")
    return parser


def config_from_args(args: argparse.Namespace) -> OrchestratorConfig:
    """Gives the orchestrator config the parsed arguments describe."""
    if not 0 < args.announce_period < args.record_ttl <= MAX_RECORD_TTL_S:
        raise SystemExit(f"swarm-orchestrator: error: need 0 < --announce-period < --record-ttl <= "
                         f"{MAX_RECORD_TTL_S:.0f} (the swarm's DHT nodes refuse records that live longer)")
    return OrchestratorConfig(
        model=args.model, initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"],
        announce_maddrs=args.announce_maddrs, identity=args.identity, variant=args.variant, rho_bar=args.rho_bar,
        prior_rate_per_s=args.prior_rate, prior_prompt_tokens=args.prior_prompt_tokens,
        prior_output_tokens=args.prior_output_tokens, rate_window_s=args.rate_window, cache_tokens=args.cache_tokens,
        refresh_period_s=args.refresh_period, announce_period_s=args.announce_period, record_ttl_s=args.record_ttl,
        lease_ttl_s=args.lease_ttl, kv_packing=args.kv_packing, packing_epoch_s=args.packing_epoch,
        batch_aware=args.batch_aware, kv_dropping=args.kv_dropping, drop_period_s=args.drop_period,
        restore_after_s=args.restore_after, restore_calm_s=args.restore_calm, metrics_port=args.metrics_port,
        metrics_host=args.host,
    )


async def serve(config: OrchestratorConfig) -> None:
    """Runs the orchestrator until SIGTERM or SIGINT."""
    orchestrator = Orchestrator(config)
    stop = asyncio.Event()
    try:
        await orchestrator.start()
        loop = asyncio.get_running_loop()  # handlers only now: the DHT's forked process must not inherit them
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        if config.metrics_port is not None:
            http = serve_metrics(OrchestratorMetrics(orchestrator).registry, config.metrics_port, config.metrics_host)
            print(f"metrics http://{config.metrics_host}:{http.server_address[1]}/metrics", flush=True)
        print(f"orchestrator ready peer_id={orchestrator.peer_id}", flush=True)
        await stop.wait()
    finally:
        await orchestrator.shutdown()


async def fetch_state(model: str, initial_peers: list[str], timeout_s: float) -> dict[str, Any]:
    """Gives the live state of the model's active orchestrator."""
    model_id = resolve_model(model).model_id
    dht = open_dht(sign=False, initial_peers=initial_peers, client_mode=True)
    try:
        p2p = await dht.replicate_p2p()
        records = await lookup_orchestrators_async(dht, model_id, timeout_s=timeout_s)
        active = active_orchestrator(records)
        if active is None:
            raise SwarmError(f"no orchestrator of {model_id} is announced in the DHT")
        connection = await dial(p2p, active.peer_id, list(active.addrs), timeout=timeout_s)
        try:
            return await connection.call("plan", {}, timeout=timeout_s)
        finally:
            await connection.close()
            await p2p.shutdown()
    finally:
        dht.shutdown()


def format_state(state: dict[str, Any]) -> str:
    """Gives the state as tables: the plan's summary, the servers' blocks and the chains."""
    bounds = state["bounds"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    lines = [
        f"orchestrator {state['orchestrator']} ({'active' if state['active'] else 'standby'}) of {state['model']}",
        f"c = {state['c']}  method = {state['method']}  arrival rate = {state['arrival_rate']:.3f} jobs/s  "
        f"queued = {state['queued']}  dispatched = {state['dispatched']}  "
        f"mean response bounds = {ms(bounds['lower_ms'])} .. {ms(bounds['upper_ms'])} ms",
        "",
        "| server | blocks |",
        "|---|---|",
        *(f"| {peer} | {start}:{end} |" for peer, (start, end) in state["blocks"].items()),
        "",
        "| chain | servers (blocks) | capacity | in use | service time ms: alone / now |",
        "|---|---|---|---|---|",
    ]
    for index, chain in enumerate(state["chains"]):
        hops = " -> ".join(f"{peer[-8:]}[{start}:{end}]"
                           for peer, (start, end) in zip(chain["servers"], chain["blocks"], strict=True))
        now_ms = chain.get("service_time_now_ms", chain["service_time_ms"])
        lines.append(f"| {index} | {hops} | {chain['capacity']} | {chain['in_use']} | "
                     f"{chain['service_time_ms']:.0f} / {now_ms:.0f} |")
    return "\n".join(lines)


def plan_main(argv: list[str]) -> None:
    """Entry point of `swarm-orchestrator plan`."""
    args = build_plan_parser().parse_args(argv)
    try:
        state = asyncio.run(fetch_state(args.model, args.initial_peers, args.timeout))
    except (SwarmError, ModelNotFound, OSError) as error:
        print(f"swarm-orchestrator plan: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(format_state(state), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the swarm-orchestrator console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        plan_main(argv[1:])
        return
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config_from_args(args)))
    except (ModelNotFound, ValueError) as error:
        print(f"swarm-orchestrator: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
