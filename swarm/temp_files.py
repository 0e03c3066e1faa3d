"""What killed processes leave under the temporary directory, and its removal.

A process that binds a Unix socket under the temporary directory (a p2p daemon, its clients, multiprocessing's
listeners, torch's shared-memory manager) removes the file when it exits cleanly; a killed one cannot. Whoever kills
it reads first what it had bound (`bound_socket_files`), then removes that after the kill (`remove_socket_files`),
with the private directory that held it: multiprocessing's `pymp-*` and torch's `torch-shm-dir-*` belong to one process
alone and go with it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil

PRIVATE_TEMP_DIRS = ("pymp-", "torch-shm-dir-")


def bound_socket_files(pids: Iterable[int]) -> list[Path]:
    """Gives the Unix socket files under the temporary directory that the live processes `pids` are bound to: the
    sockets among each one's open files, as its own network namespace lists them (`/proc/<pid>/net/unix`; the
    caller's own list does not hold another namespace's sockets)."""
    temp = Path(tempfile.gettempdir())
    paths: list[Path] = []
    for pid in pids:
        try:
            inodes = {target[len("socket:["):-1] for fd in Path(f"/proc/{pid}/fd").iterdir()
                      if (target := os.readlink(fd)).startswith("socket:[")}
            listed = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        for line in listed:  # Num RefCount Protocol Flags Type St Inode [Path]
            fields = line.split(maxsplit=7)
            if len(fields) == 8 and fields[6] in inodes and Path(fields[7]).parent.is_relative_to(temp):
                paths.append(Path(fields[7]))
    return paths


def group_socket_files(pgid: int) -> list[Path]:
    """Gives the Unix socket files under the temporary directory that the live processes of group `pgid` are bound
    to."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                members.append(process.pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return bound_socket_files(members)


def remove_socket_files(paths: Sequence[Path]) -> None:
    """Removes the socket files of killed processes, with the private directories that held them."""
    temp = Path(tempfile.gettempdir())
    for path in paths:
        if path.parent != temp and path.parent.name.startswith(PRIVATE_TEMP_DIRS):
            shutil.rmtree(path.parent, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
