"""The swarm-server entry runs the server on jemalloc where it is installed, or on glibc's malloc when told to."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.allocator import jemalloc_library, running_allocator
from server.launch import allocator_choice
from swarm.local_swarm import SwarmProcesses


def test_the_allocator_flag_is_read_from_a_full_command_line() -> None:
    assert allocator_choice(["--model", "m", "--blocks", "0:4"]) == "auto"
    assert allocator_choice(["--blocks", "0:4", "--allocator", "glibc", "--host", "127.0.0.1"]) == "glibc"
    assert allocator_choice(["--allocator=jemalloc"]) == "jemalloc"
    with pytest.raises(SystemExit):
        allocator_choice(["--allocator", "tcmalloc"])


@pytest.mark.slow
def test_servers_run_on_jemalloc_where_installed_and_on_glibc_when_told(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    chosen = swarm_factory.start_server(tiny_llama, "0:8", wait=False)
    glibc = swarm_factory.start_server(tiny_llama, "0:8", "--allocator", "glibc", wait=False)
    for proc in (chosen, glibc):
        swarm_factory.wait_ready(proc)  # re-executed once, then served: the same process, the same output
    expected = "jemalloc" if jemalloc_library() is not None else "glibc"
    assert (running_allocator(chosen.popen.pid), running_allocator(glibc.popen.pid)) == (expected, "glibc")
    assert f"malloc: {expected}" in chosen.output() and "malloc: glibc" in glibc.output()
    if expected == "jemalloc":  # re-executed on jemalloc, the server checks its flags as always
        code, output = swarm_factory.run_to_exit(
            ["-m", "server.launch", "--model", str(tiny_llama), "--blocks", "0:99", "--allocator", "jemalloc"])
        assert code == 2 and "block range" in output, output
    else:
        code, output = swarm_factory.run_to_exit(
            ["-m", "server.launch", "--model", str(tiny_llama), "--blocks", "0:8", "--allocator", "jemalloc"])
        assert code == 2 and "jemalloc is not installed" in output, output
    assert "Traceback" not in output
    code, output = swarm_factory.run_to_exit(  # past the entry, on glibc: the flag cannot be honoured
        ["-m", "server.cli", "--model", str(tiny_llama), "--blocks", "0:8", "--allocator", "jemalloc"])
    assert code == 2 and "needs the swarm-server entry" in output, output
