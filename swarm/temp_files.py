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


def bound_socket_files(pids: Iterable[int]) -> dict[int, list[Path]]:
    """Gives, for each of the live processes `pids`, the Unix socket files under the temporary directory it is bound
    to: the sockets among its open files, as its own network namespace lists them (`/proc/<pid>/net/unix`, read once
    per namespace; the caller's own list does not hold another namespace's sockets)."""
    temp = Path(tempfile.gettempdir())
    listed: dict[str, dict[str, Path]] = {}  # per namespace: socket inode -> its file under the temporary directory
    bound: dict[int, list[Path]] = {}
    for pid in pids:
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/net")
            if namespace not in listed:
                listed[namespace] = {}
                for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
                    fields = line.split(maxsplit=7)  # Num RefCount Protocol Flags Type St Inode [Path]
                    if len(fields) == 8 and Path(fields[7]).parent.is_relative_to(temp):
                        listed[namespace][fields[6]] = Path(fields[7])
            inodes = {target[len("socket:["):-1] for fd in Path(f"/proc/{pid}/fd").iterdir()
                      if (target := os.readlink(fd)).startswith("socket:[")}
        except OSError:
            continue  # gone meanwhile, or not ours to read
        bound[pid] = [listed[namespace][inode] for inode in inodes if inode in listed[namespace]]
    return bound


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
    return [path for paths in bound_socket_files(members).values() for path in paths]


def remove_socket_files(paths: Sequence[Path]) -> None:
    """Removes the socket files of killed processes, with the private directories that held them."""
    temp = Path(tempfile.gettempdir())
    for path in paths:
        if path.parent != temp and path.parent.name.startswith(PRIVATE_TEMP_DIRS):
            shutil.rmtree(path.parent, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
