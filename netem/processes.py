"""Processes started inside a host's namespace, with their output captured and a bounded, certain stop.

`ip netns exec NS cmd` enters the namespace and execs `cmd`, so the started pid is the command itself; each gets
its own process group (children such as p2pd daemons included) and its output in a log file. With
`interactive=True` its stdin and stdout are pipes for a line protocol (`send_line`, `read_line`); stderr goes to
the log.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from swarm.temp_files import group_socket_files, remove_socket_files

REPO = Path(__file__).resolve().parents[1]


def namespace_command(namespace: str, argv: Sequence[str]) -> list[str]:
    """Gives the argv that runs `argv` inside `namespace`."""
    return ["ip", "netns", "exec", namespace, *argv]


class HostProcess:
    """One process running inside a host's namespace."""

    def __init__(self, name: str, host: str, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name, self.host, self.popen, self.log_path = name, host, popen, log_path
        self._stdout_buffer = bytearray()

    @classmethod
    def start(
        cls, name: str, host: str, namespace: str, argv: Sequence[str], log_path: Path, *,
        env: Mapping[str, str] | None = None, interactive: bool = False,
    ) -> HostProcess:
        """Gives a started process running `argv` in `namespace`, its output going to `log_path`."""
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **(env or {}))
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                namespace_command(namespace, argv),
                stdin=subprocess.PIPE if interactive else subprocess.DEVNULL,
                stdout=subprocess.PIPE if interactive else log, stderr=log, env=full_env, cwd=REPO,
                start_new_session=True,
            )
        return cls(name, host, popen, log_path)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        """Gives what the process wrote to its log so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_line(self, prefix: str, timeout_s: float) -> str:
        """Gives the first log line starting with `prefix`, waiting up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            for line in self.output().splitlines():
                if line.startswith(prefix):
                    return line
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} printed no {prefix!r} within {timeout_s} s:\n{self.output()[-3000:]}")
            time.sleep(0.1)

    def send_line(self, text: str) -> None:
        assert self.popen.stdin is not None, "not started with interactive=True"
        self.popen.stdin.write(text.encode() + b"\n")
        self.popen.stdin.flush()

    def read_line(self, timeout_s: float) -> str:
        """Gives the next stdout line (interactive processes), waiting up to `timeout_s`."""
        assert self.popen.stdout is not None, "not started with interactive=True"
        fd = self.popen.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._stdout_buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name} wrote no line within {timeout_s} s:\n{self.output()[-3000:]}")
                if selector.select(min(left, 1.0)):
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        raise RuntimeError(f"{self.name} closed its output (exit {self.popen.poll()}):\n"
                                           f"{self.output()[-3000:]}")
                    self._stdout_buffer += chunk
        line, _, rest = bytes(self._stdout_buffer).partition(b"\n")
        self._stdout_buffer = bytearray(rest)
        return line.decode(errors="replace")

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Gives the JSON line an interactive process answers to one JSON line (other lines are skipped)."""
        self.send_line(json.dumps(message))
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.read_line(max(0.0, deadline - time.monotonic()))
            if line.startswith("{"):
                return json.loads(line)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """Gives the exit code after SIGTERM to the process (a clean exit), then SIGKILL to its whole group, whose
        socket files under the temporary directory go with it: those bound before the SIGTERM (a process without a
        handler for it, as a client whose `done` was read while it shut down, ends at once and can no longer be read
        after) and those still bound after it."""
        sockets = group_socket_files(self.popen.pid)
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace_s)
        sockets += group_socket_files(self.popen.pid)  # what is left of its group binds, killed, nothing again
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        remove_socket_files(sockets)
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        return self.popen.returncode
