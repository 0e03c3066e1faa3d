"""`swarm-server`: host a range of a model's blocks and serve it to the swarm until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from orchestrator.admission import DEFAULT_CLIENT_KV_SHARE, DEFAULT_CLIENT_MAX_SESSIONS, DEFAULT_HEADROOM_TOKENS
from server import allocator
from server.config import ServerConfig
from server.exchange import EXCHANGE_SETTINGS
from server.migration import IMPORT_IDLE_S, KV_CHUNK_BYTES
from server.server import SwarmServer
from swarm.dht_limits import MAX_RECORD_TTL_S
from swarm.errors import InvalidBlockRange, OutOfPages, UnsupportedArchitecture
from swarm.memory import DEFAULT_PAGE_BYTES, parse_size
from swarm.model import DEFAULT_MODEL, QUANT_MODES, ModelNotFound, parse_block_range
from swarm.process_exit import exit_now

log = logging.getLogger("swarm-server")


def _checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """Gives an argparse type that keeps the text but reports `parse`'s error as a usage error."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as error:  # InvalidBlockRange is a ValueError too
            raise argparse.ArgumentTypeError(str(error)) from None
        return text

    return check


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text}")
    return value


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Gives the argument parser of swarm-server."""
    parser = argparse.ArgumentParser(prog="swarm-server", description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="hub-style name, checkpoint folder or .gguf file")
    block_range, size = _checked(parse_block_range), _checked(parse_size)
    parser.add_argument(
        "--blocks", type=block_range,
        help="block range START:END, 0-based, end exclusive (default: from --orchestrator, or chosen by the server)",
    )
    parser.add_argument(
        "--orchestrator", metavar="PEER_ID", nargs="+", default=[],
        help="follow the block assignments of this orchestrator (name its standbys too), and no other's; without "
        "--blocks, wait for the first",
    )
    parser.add_argument(
        "--num-blocks", type=_positive,
        help="without --blocks and --orchestrator: how many blocks to host (default: as many as --memory holds, "
        "with room for the KV of 4 sessions of --max-length each)",
    )
    parser.add_argument(
        "--balance-quality", type=float, default=0.75,
        help="a server that chooses its blocks moves when another span would raise the swarm's throughput by more "
        "than 1 / this (Petals' rule)",
    )
    parser.add_argument("--rebalance-period", type=float, default=60.0, help="seconds between checks to move")
    parser.add_argument("--block-change-timeout", type=float, default=120.0,
                        help="seconds a change of blocks may wait for leaving blocks to free their pages")
    parser.add_argument("--memory", type=size, help="memory budget for parameters + KV, e.g. 2GB (default: derived)")
    parser.add_argument("--page-size", type=size, default=str(DEFAULT_PAGE_BYTES), help="bytes per memory page")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of any peers already in the swarm")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (ignored with --host-maddrs)")
    parser.add_argument("--port", type=int, default=0, help="TCP port to listen on, 0 = any")
    parser.add_argument("--host-maddrs", nargs="*", help="multiaddrs to listen on, instead of --host/--port")
    parser.add_argument("--announce-maddrs", nargs="*", default=[], help="multiaddrs others should dial (NAT, proxy)")
    parser.add_argument("--identity", type=Path, help="private key file for a stable peer id (created if missing)")
    parser.add_argument("--public-name", help="a name shown to users of the swarm (<= 64 characters)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--quant", default="none", choices=QUANT_MODES, help="bitsandbytes weight quantization")
    parser.add_argument("--max-length", type=int, default=2048, help="longest session (tokens) this server accepts")
    parser.add_argument("--session-timeout", type=float, default=300.0, help="seconds before an idle session is freed")
    parser.add_argument("--announce-period", type=float, default=10.0, help="seconds between DHT announcements")
    parser.add_argument("--record-ttl", type=float, default=30.0,
                        help=f"seconds a DHT record lives unless refreshed (at most {MAX_RECORD_TTL_S:.0f})")
    parser.add_argument("--drain-timeout", type=float, default=10.0, help="seconds to let steps finish on shutdown")
    parser.add_argument(
        "--max-batch-tokens", type=_positive, default=None,
        help="tokens one forward pass computes at most: every waiting decode step, then chunks of prefills "
        "(default 128 on CPU, 2048 on CUDA)",
    )
    parser.add_argument(
        "--kv-headroom-tokens", type=_non_negative, default=DEFAULT_HEADROOM_TOKENS,
        help="tokens each running session is expected to grow by; a new session is admitted only while the free "
        "pages cover that growth and its own",
    )
    parser.add_argument(
        "--client-max-sessions", type=_non_negative, default=DEFAULT_CLIENT_MAX_SESSIONS,
        help="open sessions one client peer may hold on this server (0: no cap); sessions that arrive by migration "
        "count against the client that opened them",
    )
    parser.add_argument(
        "--client-kv-share", type=float, default=DEFAULT_CLIENT_KV_SHARE,
        help="share of the pages that can hold KV that one client peer's sessions may hold on this server (1: no "
        "cap); a client over either quota is refused with QuotaExceeded and routes elsewhere, as from a full server",
    )
    parser.add_argument(
        "--batch-trace", type=Path, default=None, metavar="PATH",
        help="append a JSON line per batch computed to PATH: when it started, ended and was settled, its compute and "
        "CPU time and its steps (for comparing a run with the simulator; server.batch_trace)",
    )
    parser.add_argument(
        "--inline-step-ms", type=float, default=50.0,
        help="a step expected to compute within this many ms, while no other step computes, runs on the event loop "
        "instead of the compute pool, saving two thread hand-offs (0 = never)",
    )
    parser.add_argument(
        "--torch-threads", type=int, default=0,
        help="threads one step's operators use (default 0: torch's choice, one per core); 1 suits several servers "
        "sharing a few cores",
    )
    parser.add_argument(
        "--emulate-gpu", metavar="PROFILE",
        help="for experiments only: hold each batch for the time this GPU profile takes and size the pool by its "
        "memory (a100-3g.40gb, a100-2g.20gb, or a JSON file; see server/emulated_gpu.py)",
    )
    parser.add_argument(
        "--migration-chunk-size", type=_size, default=KV_CHUNK_BYTES,
        help="KV bytes one frame of a session's migration carries at most; other sessions' steps go between frames",
    )
    parser.add_argument(
        "--import-idle-timeout", type=float, default=IMPORT_IDLE_S,
        help="seconds after which a session arriving by migration whose source went silent is dropped",
    )
    parser.add_argument(
        "--kv-packing", choices=["mell", "bf", "wf", "lb"], default=None,
        help="without an orchestrator: the servers hosting the same blocks pack their sessions onto as few of them "
        "as the policy keeps (MELL, best fit, worst fit, or LB), moving sessions live; the others stand by",
    )
    parser.add_argument("--packing-epoch", type=float, default=1.0, help="seconds between two packings of a segment")
    parser.add_argument(
        "--kv-dropping", action="store_true",
        help="without an orchestrator: when the KV demand of the servers hosting the same blocks outgrows their "
        "pages, they merge into buddy groups that each keep one copy of the blocks, and the parameter pages they "
        "drop hold KV; the blocks come back once the demand fits (KunServe)",
    )
    parser.add_argument("--drop-period", type=float, default=0.5, help="seconds between two looks at the demand")
    parser.add_argument("--restore-after", type=float, default=10.0,
                        help="seconds a drop lasts at least before its blocks may be restored")
    parser.add_argument("--restore-calm", type=float, default=15.0,
                        help="seconds the demand must have stayed within 80%% of the pages the servers would have "
                        "for KV with every block back before a restore (a lull between two waves of one burst does "
                        "not restore)")
    parser.add_argument("--kv-exchange", choices=EXCHANGE_SETTINGS, default="auto",
                        help="how the sessions running over blocks a drop frees go on: 'blocking' moves their KV of "
                        "those blocks to the servers that keep them (each waits from the drop until its own moved, "
                        "and the dropped blocks' pages are free at once), 'live' goes on at once "
                        "through those servers, which have this one attend over the KV until it has followed "
                        "(KunServe's remote attention: one round trip per such block and token), 'replay' evicts "
                        "them for their clients to replay, 'auto' (default) picks per session between blocking and "
                        "replay, whichever is expected to end sooner")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port, printed)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--allocator", choices=allocator.ALLOCATORS, default="auto",
                        help="malloc of the server process: jemalloc where installed (auto), or glibc's; chosen by "
                             "the swarm-server entry before it starts (server.launch)")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Gives the server config the parsed arguments describe."""
    if args.blocks and args.num_blocks:
        raise SystemExit("swarm-server: error: --num-blocks is for a server that chooses its blocks; drop --blocks")
    if not 0 < args.balance_quality <= 1:
        raise SystemExit("swarm-server: error: --balance-quality must be in (0, 1]")
    if not 0 < args.announce_period < args.record_ttl <= MAX_RECORD_TTL_S:
        raise SystemExit(f"swarm-server: error: need 0 < --announce-period < --record-ttl <= {MAX_RECORD_TTL_S:.0f} "
                         f"(the swarm's DHT nodes refuse records that live longer)")
    return ServerConfig(
        blocks=args.blocks,
        model=args.model,
        orchestrators=tuple(args.orchestrator),
        num_blocks=args.num_blocks,
        balance_quality=args.balance_quality,
        rebalance_period_s=args.rebalance_period,
        emulate_gpu=args.emulate_gpu,
        block_change_timeout_s=args.block_change_timeout,
        memory=args.memory,
        page_bytes=parse_size(args.page_size),
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs or [f"/ip4/{args.host}/tcp/{args.port}"],
        announce_maddrs=args.announce_maddrs,
        identity=args.identity,
        public_name=args.public_name,
        device=args.device,
        dtype=args.dtype,
        quant=args.quant,
        max_length=args.max_length,
        session_timeout_s=args.session_timeout,
        announce_period_s=args.announce_period,
        record_ttl_s=args.record_ttl,
        metrics_port=args.metrics_port,
        metrics_host=args.host,
        drain_timeout_s=args.drain_timeout,
        max_batch_tokens=args.max_batch_tokens,
        kv_headroom_tokens=args.kv_headroom_tokens,
        client_max_sessions=args.client_max_sessions,
        client_kv_share=args.client_kv_share,
        inline_step_ms=args.inline_step_ms,
        batch_trace=args.batch_trace,
        torch_threads=args.torch_threads,
        migration_chunk_bytes=args.migration_chunk_size,
        import_idle_timeout_s=args.import_idle_timeout,
        kv_packing=args.kv_packing,
        packing_epoch_s=args.packing_epoch,
        kv_dropping=args.kv_dropping,
        drop_period_s=args.drop_period,
        restore_after_s=args.restore_after,
        restore_calm_s=args.restore_calm,
        kv_exchange=args.kv_exchange,
    )


async def serve(config: ServerConfig) -> None:
    """Runs a server until SIGTERM or SIGINT, then shuts it down cleanly."""
    server = SwarmServer(config)
    stop = asyncio.Event()

    served: list[bool] = []  # whether `ready` was printed

    def print_range(old: tuple[int, int], new: tuple[int, int]) -> None:
        if not served and new[1] > new[0]:
            served.append(True)
            print(f"ready peer_id={server.peer_id} blocks={new[0]}:{new[1]}", flush=True)
        elif served:
            print(f"blocks {old[0]}:{old[1]} -> {new[0]}:{new[1]}", flush=True)

    try:
        await server.start()
        # Only now: the DHT's forked process must not inherit these handlers, or it would ignore its own SIGTERM.
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        record = server.record()
        if server.metrics_port is not None:  # before `ready`: whoever waits for that may scrape at once
            print(f"metrics http://{config.metrics_host}:{server.metrics_port}/metrics", flush=True)
        if record.block_end > record.block_start:
            served.append(True)
            print(f"ready peer_id={record.peer_id} blocks={record.block_start}:{record.block_end}", flush=True)
        else:
            print(f"started peer_id={record.peer_id} waiting for blocks", flush=True)
        server.add_range_listener(print_range)
        await stop.wait()
        log.info("Signal received: draining")
    finally:
        await server.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the swarm-server console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    malloc = allocator.running_allocator()
    if args.allocator == "jemalloc" and malloc != "jemalloc":  # started as `-m server.cli`
        parser.error("--allocator jemalloc needs the swarm-server entry (server.launch) and jemalloc installed")
    allocator.limit_arenas()  # before the threads that compute start (glibc's malloc only)
    log.info("malloc: %s", malloc)
    try:
        asyncio.run(serve(config_from_args(args)))
    except (InvalidBlockRange, UnsupportedArchitecture, ModelNotFound, OutOfPages, ValueError) as error:
        print(f"swarm-server: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    exit_now(0)  # it shut down cleanly: skip the interpreter's teardown (`swarm.process_exit`)


if __name__ == "__main__":
    main()
