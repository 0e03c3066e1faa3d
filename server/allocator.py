"""The C heap of a server process: few malloc arenas, and freed memory handed back to the OS.

KV and parameters live in the page pool, one mapping that never moves. Everything else a step allocates (torch's CPU
tensors for activations and attention scores, frames, msgpack buffers) comes from glibc's malloc, which gives each
thread that allocates concurrently an arena of its own (up to 8 per core) and keeps what is freed there for reuse.
A long prompt's activations thus stay resident after it, in whichever arena its thread used: the soak benchmark saw
servers grow 6-16% outside the pool in their first minutes. A server therefore caps the arenas at start
(`limit_arenas`, as `MALLOC_ARENA_MAX` would) and hands free heap memory back to the OS every `TRIM_PERIOD_S`
(`trim`, glibc's `malloc_trim`). Other C libraries have neither call; both are then no-ops. So they are under
jemalloc, which `server.launch` preloads where it is installed: it returns freed pages on its own, and a
server then runs no trim loop (`trims`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # mallopt's parameter number, from glibc's malloc.h
ALLOCATORS = ("auto", "jemalloc", "glibc")  # `swarm-server --allocator` (chosen in server.launch)
ARENAS = 2
TRIM_PERIOD_S = 10.0


def jemalloc_library() -> str | None:
    """Gives the name of the jemalloc shared library the dynamic loader finds, or None."""
    return ctypes.util.find_library("jemalloc")


def running_allocator(pid: int | str = "self") -> str:
    """Gives the malloc process `pid` (this one by default) runs on: "jemalloc" if it is mapped, else "glibc"."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return "glibc"
    return "jemalloc" if "libjemalloc" in maps else "glibc"


@cache
def _glibc() -> ctypes.CDLL | None:
    if running_allocator() != "glibc":
        return None  # glibc's calls would tune an allocator nothing uses
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not all(hasattr(libc, symbol) for symbol in ("mallopt", "malloc_trim")):
        return None  # not glibc
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Caps the malloc arenas of this process at `arenas` (for threads started from now on); gives whether it did."""
    libc = _glibc()
    done = libc is not None and libc.mallopt(M_ARENA_MAX, arenas) == 1
    log.debug("malloc arenas capped at %d: %s", arenas, done)
    return done


def trims() -> bool:
    """Gives whether this process's malloc is glibc's, whose freed memory `trim` hands back."""
    return _glibc() is not None


def trim() -> bool:
    """Hands the free memory of every malloc arena back to the OS; gives whether any was."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1
