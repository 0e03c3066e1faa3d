"""Shared fixtures: tiny random checkpoints on disk and a factory of real swarm processes."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from swarm.local_swarm import SwarmProcesses
from tests.netem_support import remove_session_runs
from tests.tiny_models import write_tiny_checkpoint

# Property tests draw the same examples on every run and machine, so that main stays green or red for a reason; a
# random search is `pytest --hypothesis-profile default` away.
settings.register_profile("chainswarm", derandomize=True, database=None)
settings.load_profile("chainswarm")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=1)


@pytest.fixture(scope="module")
def swarm_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SwarmProcesses]:
    swarm = SwarmProcesses(tmp_path_factory.mktemp("swarm"))
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.fixture(autouse=True)
def own_swarm_stops_with_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """In a module marked `own_swarm`, stops the processes a test started when it ends, instead of with the module:
    a module of tests that each start four servers would otherwise hold dozens at once (20 GiB of the 24 GiB here)."""
    if request.node.get_closest_marker("own_swarm") is None:
        yield
        return
    swarm: SwarmProcesses = request.getfixturevalue("swarm_factory")
    try:
        yield
    finally:
        swarm.close()


@pytest.fixture(scope="session", autouse=True)
def netem_safety_net() -> Iterator[None]:
    """Removes any emulated network (namespaces, links, processes) a netem test of this session left behind."""
    yield
    leftovers = remove_session_runs()
    if leftovers:
        warnings.warn(f"netem runs left behind by tests were removed: {', '.join(leftovers)}", stacklevel=1)
