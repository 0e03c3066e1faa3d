"""Linux network namespaces of one emulation run: names, `ip` calls with timeouts, entering a namespace, cleanup.

Everything a run creates lives in namespaces named `csnet-<run id>-<host>` (plus `csnet-<run id>-_hub`, the
router), so a run is found, and removed, by its name prefix alone. Nothing is created in the caller's namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from swarm.temp_files import bound_socket_files, remove_socket_files

PREFIX = "csnet-"
HUB = "_hub"  # host names cannot start with "_", so the router namespace never collides with a host
RUN_ID = re.compile(r"^[a-z0-9]{1,16}$")
NETNS_DIR = Path("/run/netns")
IP_TIMEOUT_S = 15.0
CLONE_NEWNET = 0x40000000
SUBNET = "10.77.0"  # host i is 10.77.0.(i+1); private, and only ever inside the run's own namespaces
GATEWAY = f"{SUBNET}.254"

_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(RuntimeError):
    """A namespace or link operation failed; the message has the command and its error output."""


def new_run_id() -> str:
    """Gives a fresh run id (8 hex digits)."""
    return secrets.token_hex(4)


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id):
        raise ValueError(f"a run id is 1-16 lowercase letters or digits, got {run_id!r}")
    return run_id


def run_prefix(run_id: str) -> str:
    """Gives the name prefix of every namespace of `run_id` (unambiguous: run ids have no dash)."""
    return f"{PREFIX}{check_run_id(run_id)}-"


def host_namespace(run_id: str, host: str) -> str:
    return run_prefix(run_id) + host


def hub_namespace(run_id: str) -> str:
    return run_prefix(run_id) + HUB


def host_address(index: int) -> str:
    """Gives the private address of the `index`-th host of a run."""
    if not 0 <= index < 250:
        raise ValueError(f"host index {index} outside 0..249")
    return f"{SUBNET}.{index + 1}"


def run(argv: Sequence[str], *, timeout_s: float = IP_TIMEOUT_S, check: bool = True) -> str:
    """Gives the stdout of a command (e.g. `ip ...`), raising NetnsError with its stderr when it fails."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"{' '.join(argv)} did not finish within {timeout_s} s") from None
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def ip(*args: str, check: bool = True) -> str:
    return run(["ip", *args], check=check)


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Gives the named namespaces starting with `prefix`."""
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(name for name in names if name.startswith(prefix))


def list_runs() -> list[str]:
    """Gives the ids of runs that still have namespaces on this machine."""
    return sorted({name[len(PREFIX):].split("-", 1)[0] for name in list_namespaces()})


def namespace_pids(namespace: str) -> list[int]:
    """Gives the ids of the processes living in `namespace` (empty if it is gone)."""
    out = ip("netns", "pids", namespace, check=False)
    return [int(word) for word in out.split() if word.isdigit()]


def add_namespace(namespace: str) -> None:
    ip("netns", "add", namespace)
    ip("-n", namespace, "link", "set", "lo", "up")


@contextlib.contextmanager
def entered(namespace: str) -> Iterator[None]:
    """Runs the body with the calling thread inside `namespace`; sockets opened there stay there afterwards."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(NETNS_DIR / namespace, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _libc.setns(target, CLONE_NEWNET) != 0:
                raise NetnsError(f"setns({namespace}): {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:  # pragma: no cover - would leave this thread in the run
                raise NetnsError(f"cannot return to the original namespace: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(own)


def set_sysctls(namespace: str, values: dict[str, str]) -> None:
    """Writes `net.*` sysctls of `namespace` (/proc/sys/net resolves to the opening thread's namespace)."""
    with entered(namespace):
        for key, value in values.items():
            Path("/proc/sys", *key.split(".")).write_text(value)


def is_alive(pid: int) -> bool:
    """Gives whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """Gives the pids still alive after waiting up to `timeout_s` for them to exit."""
    deadline = time.monotonic() + timeout_s
    alive = [pid for pid in pids if is_alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if is_alive(pid)]
    return alive


def kill_namespace_processes(namespaces: Sequence[str], grace_s: float = 3.0) -> list[int]:
    """Gives the pids found in `namespaces`, after stopping them: SIGTERM, then SIGKILL to those alive after
    `grace_s` (one grace period for all, however many namespaces). The socket files they had bound under the
    temporary directory go with them (`swarm.temp_files`): a process that had no handler for SIGTERM, as torch's
    shared-memory manager, which a server started inside, left its directory behind (about 5 per arm of the burst
    benchmark)."""
    pids = sorted({pid for namespace in namespaces for pid in namespace_pids(namespace)} - {os.getpid()})
    sockets = bound_socket_files(pids)
    alive = pids
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        alive = wait_gone(alive, wait_s)
        if not alive:
            break
    remove_socket_files([path for pid, paths in sockets.items() if pid not in alive for path in paths])  # unbound now
    return pids


def remove_run(run_id: str, *, grace_s: float = 3.0) -> list[str]:
    """Gives the namespaces of `run_id` that were removed, after stopping every process living in them.

    Links (veth pairs, TUN devices) live inside those namespaces and go with them.
    """
    namespaces = list_namespaces(run_prefix(run_id))
    kill_namespace_processes(namespaces, grace_s)
    for namespace in namespaces:
        ip("netns", "delete", namespace, check=False)
    left = list_namespaces(run_prefix(run_id))
    if left:
        raise NetnsError(f"could not delete namespaces {', '.join(left)}")
    return namespaces


def support_problem() -> str | None:
    """Gives why namespaces cannot be emulated here (not root, no `ip`, no netns or TUN), or None if they can."""
    if os.geteuid() != 0:
        return "netem needs root (network namespaces and TUN devices)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "netem needs iproute2 (`ip` and `tc`)"
    if not os.path.exists("/dev/net/tun"):
        return "netem's fabric needs /dev/net/tun"
    probe = f"{PREFIX}probe{secrets.token_hex(3)}-x"
    try:
        ip("netns", "add", probe)
    except NetnsError as error:
        return f"cannot create a network namespace: {error}"
    finally:
        ip("netns", "delete", probe, check=False)
    return None
