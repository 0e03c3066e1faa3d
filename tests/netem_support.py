"""What netem tests share: why they must skip here, run ids tagged per pytest session, and the session safety net."""

from __future__ import annotations

import functools
import itertools
import secrets
import time

import psutil

from netem import netns
from netem.network import down

# Every run a test starts has an id beginning with this tag, so the session's safety net finds them all.
SESSION_TAG = "t" + secrets.token_hex(3)
_counter = itertools.count()


def next_run_id() -> str:
    """Gives a fresh run id carrying this session's tag."""
    return f"{SESSION_TAG}{next(_counter)}"


@functools.cache
def skip_reason() -> str | None:
    """Gives why netem cannot run here (root, iproute2, netns, TUN), or None."""
    return netns.support_problem()


def remove_session_runs() -> list[str]:
    """Gives the ids of this session's runs that were still up, after taking them down."""
    leftovers = [run_id for run_id in netns.list_runs() if run_id.startswith(SESSION_TAG)]
    for run_id in leftovers:
        down(run_id)
    return leftovers


def wait_for_quiet_cpu(busy_below_pct: float = 50.0, window_s: float = 0.5, timeout_s: float = 20.0) -> float:
    """Waits until the machine's CPUs were busy less than `busy_below_pct` over a `window_s` window (at most
    `timeout_s`); gives the last window's busy share. Freshly started processes (a swarm's servers announcing, a
    client importing torch) otherwise starve the probes that time RTTs to a tenth of a millisecond."""
    deadline = time.monotonic() + timeout_s
    busy = psutil.cpu_percent(interval=window_s)
    while busy >= busy_below_pct and time.monotonic() < deadline:
        busy = psutil.cpu_percent(interval=window_s)
    return busy
