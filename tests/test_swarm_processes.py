"""`SwarmProcesses.close`: what a process that SIGTERM ends at once had bound under the temporary directory goes with
it, read before the signal."""

from __future__ import annotations

import secrets
import signal
import tempfile
import textwrap
from pathlib import Path

from swarm.local_swarm import SwarmProcesses

# A process that binds a socket in a private directory of its own, as multiprocessing's resource sharer does
# (`pymp-*/listener-*`: hivemind's futures to its DHT process start it), and keeps no handler for SIGTERM.
LISTENER_HOLDER = textwrap.dedent("""
    import socket, sys, tempfile, time
    path = tempfile.mkdtemp(prefix="pymp-" + sys.argv[1])
    held = socket.socket(socket.AF_UNIX)
    held.bind(path + "/listener-held")
    print("ready", flush=True)
    time.sleep(300)
""")


def held_directories(tag: str) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"pymp-{tag}*"))


def test_closing_removes_the_private_socket_directory_of_a_process_that_sigterm_ends_at_once(tmp_path: Path) -> None:
    # as swarm-api was before it handled SIGTERM: once the signal ended it, its group had no process left to read the
    # directory from, and SIGKILL to the group found nothing to remove
    tag = secrets.token_hex(4)
    with SwarmProcesses(tmp_path) as swarm:
        holder = swarm.run_in_background(["-c", LISTENER_HOLDER, tag], name="holder")
        swarm.wait_for_line(holder, "ready", 30)
        held = held_directories(tag)
        assert len(held) == 1 and (held[0] / "listener-held").is_socket()
    assert holder.popen.returncode == -signal.SIGTERM  # no handler: the signal ended it
    assert held_directories(tag) == []
