"""swarm-dht: runs a bootstrap DHT node, prints its multiaddrs as `initial_peers: ...`, and stops on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from swarm.process_exit import exit_now
from swarm.signing import open_dht

logger = logging.getLogger(__name__)

# How often the main thread re-checks the stop flag; bounds shutdown latency, not correctness.
_STOP_POLL_S = 0.5


def _split_maddrs(values: Sequence[str] | None) -> list[str]:
    # Each flag may be repeated and each value may hold several space-separated multiaddrs.
    return [maddr for value in values or () for maddr in value.split()]


def _host_maddr(host: str, port: int) -> str:
    protocol = "ip6" if ":" in host else "ip4"
    return f"/{protocol}/{host}/tcp/{port}"


def build_parser() -> argparse.ArgumentParser:
    """Gives the argument parser of swarm-dht."""
    parser = argparse.ArgumentParser(prog="swarm-dht", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="TCP port to listen on; 0 picks a free one")
    parser.add_argument(
        "--initial-peers",
        action="append",
        metavar="MADDR",
        help="multiaddrs of peers of an existing swarm to join (repeatable, or space separated)",
    )
    parser.add_argument("--identity", metavar="PATH", help="private key file for a stable peer id; created if missing")
    parser.add_argument(
        "--announce-maddrs",
        action="append",
        metavar="MADDR",
        help="multiaddrs other peers should dial, e.g. behind NAT (repeatable, or space separated)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Gives the exit code after serving a DHT node until SIGTERM or SIGINT."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"--port must be in 0..65535, got {args.port}")

    dht_kwargs: dict[str, object] = {}
    announce_maddrs = _split_maddrs(args.announce_maddrs)
    if announce_maddrs:
        dht_kwargs["announce_maddrs"] = announce_maddrs
    dht = open_dht(  # it stores only records their peers signed (`swarm.signing`)
        identity=Path(args.identity) if args.identity else None,
        initial_peers=_split_maddrs(args.initial_peers),
        host_maddrs=[_host_maddr(args.host, args.port)],
        **dht_kwargs,
    )
    stop_requested = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        stop_requested.set()

    # Installed only after the DHT process is forked, so that process keeps hivemind's own handling.
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        maddrs = dht.get_visible_maddrs()
        print("initial_peers: " + " ".join(str(maddr) for maddr in maddrs), flush=True)
        while not stop_requested.wait(_STOP_POLL_S):
            if not dht.is_alive():
                logger.error("the DHT process exited unexpectedly")
                return 1
    finally:
        dht.shutdown()
    return 0


def run() -> NoReturn:
    """Entry point of the swarm-dht console script: serves, then ends without the interpreter's teardown."""
    exit_now(main())


if __name__ == "__main__":
    run()
