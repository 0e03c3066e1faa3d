"""Takes the README's picture of the live swarm page: a local SmolLM2 swarm placed by an orchestrator, serving chat
requests through `swarm-api`, drawn by Debian's Chromium.

Starts a DHT bootstrap, a `swarm-orchestrator`, three servers that follow it (each with memory for part of the model,
so that the plan is a pipeline), and `swarm-api`; keeps a few chat requests streaming, and saves a screenshot of
`GET /` while they run. Everything stops at the end (also on Ctrl-C).

    .venv/bin/python -m examples.page_screenshot [--out docs/swarm-page.png] [--keep-logs]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx
from playwright.sync_api import sync_playwright

from swarm.local_swarm import SwarmProcesses, threads_per_server
from swarm.model import DEFAULT_MODEL

CHROMIUM = "/usr/bin/chromium"
FOLLOWERS = (("alice", "320MB"), ("bob", "320MB"), ("carol", "200MB"))
QUESTIONS = ("Tell me about volunteer computing.", "Why is the sky blue?", "Write a haiku about GPUs.")
WAIT_S = 180.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/swarm-page.png"), help="where the PNG goes")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' log folder after exit")
    return parser


def wait_for_plan(api_url: str, followers: int) -> dict[str, object]:
    """Gives the page's view once every follower serves blocks and the orchestrator has chains over all of them."""
    deadline = time.monotonic() + WAIT_S
    view: dict[str, object] = {}
    while time.monotonic() < deadline:
        view = httpx.get(f"{api_url}/api/v1/swarm", timeout=30).json()
        servers = [server for server in view["servers"] if server["state"] == "online"]  # type: ignore[union-attr]
        if len(servers) == followers and min(view["coverage"]) > 0 and view["chains"]:  # type: ignore[type-var]
            return view
        time.sleep(1.0)
    raise TimeoutError(f"no plan over every block within {WAIT_S} s: {view}")


def chat(api_url: str, question: str, done: threading.Event) -> None:
    """Streams replies to `question` until `done` is set."""
    while not done.is_set():
        with httpx.stream("POST", f"{api_url}/v1/chat/completions", timeout=WAIT_S, json={
                "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 200,
                "stream": True}) as response:
            for _line in response.iter_lines():
                if done.is_set():
                    break


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="chainswarm-page-"))
    done = threading.Event()
    threads: list[threading.Thread] = []
    try:
        with SwarmProcesses(workdir, torch_threads=threads_per_server(len(FOLLOWERS))) as swarm:
            swarm.start_dht()
            orchestrator = swarm.start_orchestrator(DEFAULT_MODEL, "--refresh-period", "1")
            _proc, api_url = swarm.start_api(DEFAULT_MODEL)  # first, so that the page sees the servers join
            for name, memory in FOLLOWERS:
                swarm.start_server(DEFAULT_MODEL, None, "--orchestrator", orchestrator.peer_id, "--memory", memory,
                                   "--public-name", name, "--max-length", "1024")
            wait_for_plan(api_url, len(FOLLOWERS))
            threads = [threading.Thread(target=chat, args=(api_url, question, done), daemon=True)
                       for question in QUESTIONS]
            for thread in threads:
                thread.start()
            time.sleep(40.0)  # the sessions open and decode, and the plan settles to their arrival rate
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
                try:
                    page = browser.new_page(viewport={"width": 1200, "height": 760})
                    page.goto(api_url)
                    page.wait_for_selector("[data-peer]", timeout=WAIT_S * 1000)
                    time.sleep(3.0)  # one more refresh, so the page shows the running sessions
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(args.out), full_page=True)
                finally:
                    browser.close()
            done.set()
            print(f"saved {args.out}")
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=30)
        if args.keep_logs:
            print(f"logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
