"""Property-based fuzzing of every RPC method of a live server: payloads built from the fields the methods read,
filled with values of every wire type (tensors of random shapes and dtypes among them), near-valid and junk. No
payload may crash the server or draw an untyped error (`InternalServerError`, or a code the client does not know),
and once the fuzzer's sessions and imports are gone, every page is back in the pool."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.swarm_client import SwarmClient
from swarm.errors import InternalServerError, RemoteError, SwarmError
from swarm.local_swarm import Proc, SwarmProcesses
from swarm.model import resolve_model
from swarm.wire import encode_tensor
from tests.test_migration import infos

pytestmark = pytest.mark.slow
METHODS = ("info", "open", "step", "steps", "push", "close", "assign", "drop", "restore", "migrate", "import_open",
           "import_kv", "import_commit", "import_abort", "kv_report", "export", "attend_open", "attend",
           "attend_read", "attend_release")
FIELDS = ("session_id", "blocks", "max_length", "batch", "step_id", "position", "hidden", "next", "then",
          "compression", "output", "wait_ms", "steps", "peer_id", "mode", "pieces", "block", "row", "start", "end",
          "tokens", "queries", "keys", "values", "tail_from", "into", "to", "merge", "client", "lease_id",
          "last_step_id", "last_output", "addrs", "prompt_tokens", "moved_from", "sessions", "epoch", "plan")
TIMEOUT_S = 30.0
SETTLE_S = 20.0  # the fuzzer's imports expire after --import-idle-timeout, its sessions after --session-timeout

ints = st.one_of(st.integers(-2, 70), st.integers(-(2**63), 2**63 - 1))
tensors = st.builds(
    lambda shape, dtype: encode_tensor(torch.zeros(shape, dtype=dtype)),
    st.lists(st.integers(0, 9), min_size=0, max_size=4),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]),
)
junk_tensors = st.fixed_dictionaries({"dtype": st.sampled_from(["float32", "int8", "complex64", ""]),
                                      "shape": st.lists(ints, max_size=5), "data": st.binary(max_size=64)})
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=40),
                    st.binary(max_size=40), st.sampled_from(["0:8", "fp16", "last", "all", "kv", "replay", "auto"]))
values = st.recursive(
    st.one_of(scalars, tensors, junk_tensors, st.lists(st.integers(-1, 9), min_size=2, max_size=2)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4)),
    max_leaves=12,
)
junk_payloads = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)
TEMPLATES = {  # a well-formed payload of each method for the tiny Llama's blocks 0:8 (hidden 64, 2 KV heads of 16)
    "open": {"blocks": [0, 8], "max_length": 64},
    "step": {"session_id": "s", "hidden": encode_tensor(torch.zeros(1, 2, 64)), "step_id": "0", "position": 0},
    "push": {"session_id": "s", "hidden": encode_tensor(torch.zeros(1, 1, 64)), "step_id": "0", "position": 0},
    "import_open": {"session_id": "i", "blocks": [0, 2], "batch": 1, "max_length": 64, "position": 2},
    "import_kv": {"session_id": "i", "pieces": [{"block": 0, "row": 0, "start": 0,
                                                 "keys": encode_tensor(torch.zeros(2, 2, 16)),
                                                 "values": encode_tensor(torch.zeros(2, 2, 16))}]},
    "attend_open": {"session_id": "a", "blocks": [0, 2], "batch": 1, "max_length": 64, "position": 2},
    "attend": {"session_id": "a", "block": 0, "position": 0, "tokens": 1,
               "queries": encode_tensor(torch.zeros(1, 4, 16)), "keys": encode_tensor(torch.zeros(1, 2, 16)),
               "values": encode_tensor(torch.zeros(1, 2, 16))},
}


def _changed(template: dict[str, Any], name: str, value: object, drop: bool) -> dict[str, Any]:
    changed = {**template, name: value}
    if drop:
        del changed[name]
    return changed


# (method, payload): any method with junk, or a method's well-formed payload with one field changed or dropped
calls = st.one_of(
    st.tuples(st.sampled_from(METHODS), junk_payloads),
    st.sampled_from(sorted(TEMPLATES)).flatmap(lambda method: st.tuples(st.just(method), st.builds(
        _changed, st.just(TEMPLATES[method]), st.sampled_from(FIELDS), values, st.booleans()))),
)


@pytest.fixture(scope="module")
def server(swarm_factory: SwarmProcesses, tiny_llama: Path) -> Proc:
    swarm_factory.start_dht()
    return swarm_factory.start_server(tiny_llama, "0:8", "--import-idle-timeout", "2", "--session-timeout", "3")


def test_every_method_answers_any_payload_with_a_typed_error_or_a_result_and_no_page_leaks(
    swarm_factory: SwarmProcesses, server: Proc, tiny_llama: Path
) -> None:
    client = SwarmClient(resolve_model(str(tiny_llama)).model_id, 8, swarm_factory.initial_peers)
    outcomes: Counter[str] = Counter()
    try:
        record = client.run(client.servers())[server.peer_id]
        baseline = record.pages_free
        connection = client.run(client.connect(record))

        @settings(max_examples=600, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(call=calls)
        def fuzz(call: tuple[str, dict[str, Any]]) -> None:
            nonlocal connection
            method, payload = call
            if connection.is_closed:  # a frame the server refused ends the stream: a new one
                connection = client.run(client.connect(record))
            try:
                client.run(connection.call(method, payload, timeout=TIMEOUT_S))
                outcomes[f"{method}: ok"] += 1
            except SwarmError as error:
                assert not isinstance(error, InternalServerError | RemoteError), f"{method}({payload!r:.300}): {error}"
                outcomes[f"{method}: {error.code}"] += 1

        fuzz()
        client.run(connection.close())  # the sessions it opened close with it
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            info = infos(client)[server.peer_id]
            if info["record"]["pages_free"] == baseline:
                break
            time.sleep(0.5)
        assert info["record"]["pages_free"] == baseline, f"pages leaked; outcomes: {dict(outcomes)}"
        assert server.popen.poll() is None  # still serving
        assert sum(count for outcome, count in outcomes.items() if outcome.endswith(": ok")) > 0
    finally:
        client.shutdown()
