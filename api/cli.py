"""`swarm-api`: serves a swarm's model over OpenAI's HTTP API.

    swarm-api --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/QmBootstrap... [--model NAME] [--port 8000]

Prints `ready http://HOST:PORT` once it listens; SIGTERM or SIGINT stop it. `/` shows the swarm live.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType

import uvicorn

from api.app import create_app
from api.engine import Engine
from api.metrics import ApiMetrics
from api.swarm_view import SwarmWatcher
from client import ClientConfig, DistributedModelForCausalLM
from swarm.model import DEFAULT_MODEL, ModelNotFound, resolve_model
from swarm.process_exit import exit_now

log = logging.getLogger(__name__)

# An idle keep-alive connection stays open this long (s). uvicorn's default, 5 s, equals httpx's idle expiry (the
# openai client's), so a request sent on a connection idle ~5 s could meet the server's close: "Server disconnected
# without sending a response" (seen once in tests/test_api.py under the full suite). 75 s, as nginx's default.
KEEP_ALIVE_S = 75


class Stopped(Exception):
    """SIGTERM or SIGINT asked the API to stop (`_stop`)."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-api", description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="+", required=True, help="multiaddrs of the swarm's DHT")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the model the swarm serves (default: %(default)s)")
    parser.add_argument("--served-model-name", help="the name requests use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-concurrency", type=int, default=32,
                        help="generations that run at once; more requests wait for one to end")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (then 504)")
    parser.add_argument("--route-wait", type=float, default=5.0,
                        help="seconds a request waits for blocks no server covers, for a server with room, or in "
                             "the orchestrator's queue for a free chain (then 503)")
    parser.add_argument("--page-period", type=float, default=2.0,
                        help="seconds between two reads of the swarm for the live page (`/`, `/api/v1/swarm`)")
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the swarm-api console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_concurrency < 1 or args.timeout <= 0 or args.route_wait < 0 or args.page_period <= 0:
        raise SystemExit("swarm-api: error: need --max-concurrency >= 1, --timeout > 0, --route-wait >= 0 and "
                         "--page-period > 0")
    try:
        source = resolve_model(args.model)
    except ModelNotFound as error:
        print(f"swarm-api: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    model = DistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers,
        client_config=ClientConfig(route_wait_s=args.route_wait, busy_wait_s=args.route_wait,
                                   orchestrator_queue_timeout_s=args.route_wait,
                                   request_timeout_s=min(args.timeout, 120.0)),
    )
    names = list(dict.fromkeys([args.served_model_name or args.model, args.model, source.model_id]))
    engine = Engine(model, names=names, max_concurrency=args.max_concurrency, timeout_s=args.timeout,
                    metrics=ApiMetrics())
    watcher = SwarmWatcher(model.swarm, names[0], period_s=args.page_period)
    config = uvicorn.Config(create_app(engine, watcher), host=args.host, port=args.port,
                            log_level=args.log_level.lower(), timeout_graceful_shutdown=5,
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = uvicorn.Server(config)
    original_startup = server.startup

    async def startup(sockets: object = None) -> None:
        await original_startup(sockets)  # type: ignore[arg-type]
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
            print(f"ready http://{args.host}:{port}", flush=True)

    server.startup = startup  # type: ignore[method-assign]
    try:
        # uvicorn drains its connections on SIGTERM or SIGINT, then raises the signal again to the handler that was
        # there before it: by default SIGTERM's ended the process at once, without the engine's shutdown (its DHT
        # process and p2p daemon were left to whoever killed the group) or the atexit handlers (multiprocessing's
        # temporary directory stayed). This one ends `run` instead. Set only now: the DHT's process, forked while the
        # model opened, keeps the default handlers.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _stop)
        server.run()
    except Stopped as stopped:
        log.info("Stopping on %s", stopped)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)  # a second signal during the shutdown ends the process at once
        engine.shutdown()
    exit_now(0)  # it shut down cleanly: skip the interpreter's teardown (`swarm.process_exit`)


if __name__ == "__main__":
    main()
