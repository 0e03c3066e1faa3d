"""A server's batch trace: one record per batch its scheduler computed, with when it ran and what it held."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from server.batch_trace import BatchTrace
from server.cli import build_parser, config_from_args
from tests.test_scheduler import Engine, decode_beside_a_held_chunk, hold_at_block, prefilled, scenario


def test_the_trace_records_a_chunk_and_the_decode_step_that_passed_it_in_time_order(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step passes a prompt's chunk: the trace holds the chunk's batch and the pass, each with its steps
    (session, tokens, decode or not, admitted), and the pass ran inside the chunk's time and ended before it."""
    async def body() -> None:
        records: list[dict] = []
        engine = Engine(tiny_llama, pages=64, max_batch_tokens=64)
        engine.scheduler.trace = records.append
        (decoding,) = await prefilled(engine, "decoding")
        long = engine.open("long")
        started, release = hold_at_block(monkeypatch, 1)
        before = time.time()
        await decode_beside_a_held_chunk(engine, decoding, long, started, release)
        await engine.scheduler.stop()
        engine.sessions.close_all()
        engine.pool.check_invariants()

        first, passing, chunk = records
        assert first["steps"][0][:3] == ["decoding", 4, False] and not first["passed"]
        assert passing["passed"] and passing["steps"][0][:3] == ["decoding", 1, True]
        assert chunk["steps"][0][:3] == ["long", 30, False] and not chunk["passed"]
        for record in records:
            assert record["start"] <= record["end"] <= record["settled"] + 1e-3
            assert record["compute_ms"] >= 0 and record["cpu_ms"] >= 0 and record["place"] == "pool"
            assert all(admitted <= record["start"] + 1e-3 for *_, admitted in record["steps"])
        assert before <= chunk["start"] <= passing["start"] <= passing["end"] <= chunk["end"]
        assert passing["steps"][0][3] >= chunk["start"] - 1e-3  # admitted while the chunk computed

    scenario(body)


def test_the_trace_file_holds_one_json_line_per_record_and_takes_none_once_closed(tmp_path: Path) -> None:
    trace = BatchTrace(tmp_path / "sub" / "a-batches.jsonl")
    trace.note({"start": 1.0, "steps": [["s", 1, True, 0.5]]})
    trace.note({"start": 2.0, "steps": []})
    trace.close()
    trace.note({"start": 3.0})
    lines = (tmp_path / "sub" / "a-batches.jsonl").read_text().splitlines()
    assert [json.loads(line)["start"] for line in lines] == [1.0, 2.0] and trace.written == 2


def test_a_trace_whose_writes_fail_stops_with_a_warning_and_takes_no_more(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trace = BatchTrace(tmp_path / "a-batches.jsonl")
    trace.note({"start": 1.0})

    class FullDisk:
        def write(self, line: str) -> int:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            pass

    written, trace._file = trace._file, FullDisk()  # type: ignore[assignment]
    trace.note({"start": 2.0})  # no exception reaches the scheduler
    trace.note({"start": 3.0})
    assert written is not None
    written.close()
    assert trace.written == 1 and "stopped after 1 lines" in caplog.text
    assert (tmp_path / "a-batches.jsonl").read_text().count("\n") == 1


def test_swarm_server_takes_the_trace_path_from_its_command_line(tmp_path: Path) -> None:
    path = tmp_path / "a-batches.jsonl"
    assert config_from_args(build_parser().parse_args(["--batch-trace", str(path)])).batch_trace == path
    assert config_from_args(build_parser().parse_args([])).batch_trace is None
