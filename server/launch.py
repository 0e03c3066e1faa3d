"""`swarm-server`'s entry: the server runs under jemalloc when the machine has it, then `server.cli` takes over.

glibc's malloc keeps freed memory resident while a page of it still holds one live chunk, and `malloc_trim` returns
only whole free pages. A server's long prompts, replays and bursts of sessions leave its heap fragmented: in the soak
(benchmarks/RESULTS.md) the survivors that served most held 24-27 MiB more than a server that had served a minute,
all of it free memory, with glibc whether one malloc arena or two. jemalloc returns dirty pages on its own after
`dirty_decay_ms`: under it every survivor ended within 2.1% of the reference, and each process used about 60 MiB
less.

A process's allocator is fixed when it starts, so the entry re-executes itself once with jemalloc preloaded, before
anything heavy is imported (torch's CPU launcher, `torch.backends.xeon.run_cpu`, preloads jemalloc the same way).
`--allocator glibc` keeps glibc's malloc (its arenas are then capped and trimmed, `server.allocator`);
`--allocator jemalloc` fails when jemalloc is missing; `auto` (the default) takes jemalloc when it is installed
(Debian: `libjemalloc2`, which `scripts/setup-venv` installs when it runs as root). An existing `MALLOC_CONF` is kept.
"""

from __future__ import annotations

import argparse
import os
import sys

from server.allocator import ALLOCATORS, jemalloc_library, running_allocator

# Background purging: idle servers return dirty pages without waiting for their next allocation.
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:5000,muzzy_decay_ms:0"
_REEXECUTED = "CHAINSWARM_ALLOCATOR_REEXEC"  # set in the re-executed process: at most one re-execution


def allocator_choice(argv: list[str]) -> str:
    """Gives the `--allocator` of a command line (the full parser in `server.cli` checks the rest)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--allocator", choices=ALLOCATORS, default="auto")
    return parser.parse_known_args(argv)[0].allocator


def main() -> None:
    """Entry point of the swarm-server console script and of `python -m server.launch`."""
    choice = allocator_choice(sys.argv[1:])
    if choice != "glibc" and running_allocator() != "jemalloc" and _REEXECUTED not in os.environ:
        library = jemalloc_library()
        if library is not None:
            env = dict(os.environ, **{_REEXECUTED: library})
            env["LD_PRELOAD"] = " ".join(filter(None, (env.get("LD_PRELOAD"), library)))
            env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
            sys.stdout.flush()
            os.execve(sys.executable, sys.orig_argv, env)  # does not return
    if choice == "jemalloc" and running_allocator() != "jemalloc":
        print("swarm-server: error: --allocator jemalloc, but jemalloc is not installed or did not load "
              "(Debian: apt-get install libjemalloc2)", file=sys.stderr, flush=True)
        sys.exit(2)
    from server.cli import main as serve

    serve()


if __name__ == "__main__":
    main()
