"""The fit of what a live run's processes outside the simulator's cost per token and per refused round, and the
reading of what computing on every core at once costs the machine (`benchmarks/corun.py`)."""

from __future__ import annotations

import numpy as np

from benchmarks.corun import measure_corun
from benchmarks.machine_cpu import fit_untracked, role_of

SERVER, SERVER_DHT, CLIENT, CLIENT_DHT, P2PD, FABRIC = 10, 11, 20, 21, 30, 40


def samples_of(tokens_per_s: list[int], rounds_per_s: list[int], piped_per_s: list[int] | None = None
               ) -> tuple[list[dict], list[float], list[float], list[float]]:
    """A run sampled once a second, whose untracked processes spend 20 ms/s anyway, 4 ms a token through one server,
    6 ms a token through a group (`piped_per_s`: one more leg between members) and 60 ms a refused round (split between
    the DHT nodes forked by the client and the server, the client's p2pd and the fabric), its client 10 ms a token and
    8 ms a round, and its server much more than either (tracked: it must not count)."""
    piped_per_s = piped_per_s or [0] * len(tokens_per_s)
    cpu = {SERVER: 0.0, SERVER_DHT: 0.0, CLIENT: 0.0, CLIENT_DHT: 0.0, P2PD: 0.0, FABRIC: 0.0}
    parents = {SERVER: 1, SERVER_DHT: SERVER, CLIENT: 1, CLIENT_DHT: CLIENT, P2PD: CLIENT, FABRIC: 1}
    roles = {SERVER: "server", SERVER_DHT: "server", CLIENT: "client", CLIENT_DHT: "client", P2PD: "p2pd",
             FABRIC: "fabric"}
    samples, tokens, rounds, piped = [], [], [], []
    for second, (tokens_now, rounds_now, piped_now) in enumerate(zip(tokens_per_s, rounds_per_s, piped_per_s,
                                                                     strict=True)):
        samples.append({"t": 1000.0 + second, "procs": [[pid, parents[pid], roles[pid], cpu[pid]] for pid in cpu]})
        tokens += [1000.0 + second + (i + 0.5) / tokens_now for i in range(tokens_now)]
        rounds += [1000.0 + second + (i + 0.5) / rounds_now for i in range(rounds_now)]
        piped += [1000.0 + second + (i + 0.5) / piped_now for i in range(piped_now)]
        cpu[P2PD] += 0.004 * piped_now
        cpu[FABRIC] += 0.002 * piped_now
        cpu[SERVER] += 0.3 + 0.05 * tokens_now
        cpu[CLIENT] += 0.010 * tokens_now + 0.008 * rounds_now
        cpu[CLIENT_DHT] += 0.020 * rounds_now
        cpu[SERVER_DHT] += 0.010 * rounds_now  # it answers the client's lookups
        cpu[P2PD] += 0.010 + 0.003 * tokens_now + 0.020 * rounds_now
        cpu[FABRIC] += 0.010 + 0.001 * tokens_now + 0.010 * rounds_now
    samples.append({"t": 1000.0 + len(tokens_per_s), "procs": [[pid, parents[pid], roles[pid], cpu[pid]]
                                                               for pid in cpu]})
    return samples, tokens, rounds, piped


def test_the_untracked_cpu_splits_into_a_part_per_token_and_a_part_per_refused_round() -> None:
    rng = np.random.default_rng(0)
    tokens_per_s = [int(n) for n in rng.integers(0, 30, 40)]
    rounds_per_s = [int(n) for n in rng.integers(0, 5, 40)]
    samples, tokens, rounds, _ = samples_of(tokens_per_s, rounds_per_s)
    fit = fit_untracked(samples, tokens, rounds)
    assert fit is not None and fit.intervals == 40 and fit.piped_token_ms is None  # no token crossed a group
    assert abs(fit.token_ms - 4.0) < 1e-6
    assert abs(fit.round_ms - 60.0) < 1e-6  # the DHT nodes count: the rounds' lookups run in them
    assert abs(fit.client_round_ms - 8.0) < 1e-6  # the client's main process, apart: its tokens are its known work
    assert abs(fit.refused_round_ms - 68.0) < 1e-6


def test_tokens_through_a_group_get_their_own_figure() -> None:
    rng = np.random.default_rng(1)
    tokens_per_s, piped_per_s = [int(n) for n in rng.integers(0, 30, 40)], [int(n) for n in rng.integers(0, 30, 40)]
    samples, tokens, rounds, piped = samples_of(tokens_per_s, [int(n) for n in rng.integers(0, 5, 40)], piped_per_s)
    fit = fit_untracked(samples, tokens, rounds, piped)
    assert fit is not None and fit.piped_token_ms is not None
    assert abs(fit.token_ms - 4.0) < 1e-6 and abs(fit.piped_token_ms - 6.0) < 1e-6 and abs(fit.round_ms - 60.0) < 1e-6


def test_too_few_samples_fit_nothing_and_a_run_without_refused_rounds_fits_no_round() -> None:
    samples, tokens, rounds, _ = samples_of([10] * 5, [1] * 5)
    assert fit_untracked(samples, tokens, rounds) is None
    samples, tokens, _, piped = samples_of([int(n) for n in np.random.default_rng(2).integers(0, 30, 20)], [0] * 20)
    fit = fit_untracked(samples, tokens, [], piped)
    assert fit is not None and fit.round_ms is None and fit.refused_round_ms is None
    assert abs(fit.token_ms - 4.0) < 1e-6


def test_a_process_is_known_by_its_command_line() -> None:
    assert role_of("/usr/bin/python -m netem.fabric --config f.json") == "fabric"
    assert role_of(".venv/lib/python3.11/site-packages/hivemind/hivemind_cli/p2pd -listen ...") == "p2pd"
    assert role_of("python benchmarks/table1_client.py --model m") == "client"
    assert role_of("python -m server.launch --blocks 0:30") == "server"
    assert role_of("python something_else.py") == "other"


def test_the_corun_reading_computes_a_servers_blocks_alone_then_on_every_core_and_relates_the_two() -> None:
    # real processes computing the served model's first block; what every core costs is the machine's, not asserted
    reading = measure_corun(blocks=1, seconds=0.3, rounds=1, cores=2)
    assert (reading.cores, reading.blocks, reading.rounds) == (2, 1, 1)
    assert reading.alone_ms > 0 and reading.wall > 0 and reading.cpu > 0 and reading.stretch > 0
