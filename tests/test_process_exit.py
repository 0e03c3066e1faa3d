"""`swarm.process_exit.exit_now`: a process that stopped cleanly ends with its atexit work done and its output
flushed, and with the code it was given."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit, sys
from pathlib import Path
from swarm.process_exit import exit_now
atexit.register(Path(sys.argv[1]).write_text, "atexit ran")
print("buffered, no newline", end="")  # a pipe buffers stdout: only a flush writes it
sys.stderr.write("to stderr")
exit_now(3)
raise AssertionError("exit_now returned")
"""


def test_exit_now_runs_the_atexit_handlers_flushes_both_streams_and_exits_with_its_code(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(marker)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert (done.returncode, done.stdout, done.stderr) == (3, "buffered, no newline", "to stderr")
    assert marker.read_text() == "atexit ran"
