"""Ends a swarm process once it has shut itself down, without the interpreter's teardown.

A server or DHT node that stopped cleanly has already let go of everything outside the process: it announced that it
leaves, closed its sessions and streams, and stopped its DHT process and p2pd. What remains is CPython's finalization,
which collects every module and object (torch, transformers, hivemind): 0.6 s of CPU for one server here, and four
servers that stop together on two cores waited 2 s for it. `exit_now` runs the `atexit` handlers (temporary
identities, multiprocessing's cleanup, logging's flush) and the standard streams' flush, then ends the process.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Runs the atexit handlers, flushes stdout and stderr, and ends the process with `code`."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to flush into
            pass
    os._exit(code)
