"""Server records: valid ones round-trip through the wire form, anything malformed is dropped."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from swarm.records import SOFTWARE_VERSION, ServerRecord, ServerState


def make_wire(**overrides: Any) -> dict[str, Any]:
    """Gives the wire form of a valid record, with some fields replaced."""
    wire: dict[str, Any] = {
        "peer_id": "12D3KooWPeer",
        "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "block_start": 4,
        "block_end": 12,
        "state": "online",
        "pages_total": 100,
        "pages_params": 40,
        "pages_kv": 10,
        "pages_free": 50,
        "sessions_fit": 5,
        "page_bytes": 1 << 20,
        "kv_bytes_per_token": 1536,
        "block_compute_ms": 0.8,
        "block_decode_ms": [{"batch": 1, "ms": 0.8}, {"batch": 8, "ms": 1.1}, {"batch": 32, "ms": 2.5}],
        "network_mbps": None,
        "session_count": 2,
        "max_length": 2048,
        "dtype": "bfloat16",
        "quant": "none",
        "version": SOFTWARE_VERSION,
        "public_name": "alice's laptop",
        "addrs": ["/ip4/127.0.0.1/tcp/4000/p2p/12D3KooWPeer"],
    }
    wire.update(overrides)
    return wire


def test_valid_record_round_trips_through_msgpack() -> None:
    record = ServerRecord.from_wire(make_wire(network_mbps=93.5))
    assert record is not None
    assert record.state is ServerState.online
    assert record.block_range == range(4, 12)
    wire = record.to_wire()
    assert wire["state"] == "online"
    assert ServerRecord.from_wire(msgpack.unpackb(msgpack.packb(wire))) == record


def test_record_accepts_an_int_where_a_float_is_expected() -> None:
    record = ServerRecord.from_wire(make_wire(block_compute_ms=3))
    assert record is not None and record.block_compute_ms == 3.0


def test_record_is_frozen() -> None:
    record = ServerRecord.from_wire(make_wire())
    assert record is not None
    with pytest.raises(ValueError, match="frozen"):
        record.session_count = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("case", "overrides"),
    [
        ("empty range", {"block_start": 5, "block_end": 5}),
        ("reversed range", {"block_start": 6, "block_end": 5}),
        ("negative start", {"block_start": -1}),
        ("end past the limit", {"block_end": 100_001}),
        ("pages do not add up", {"pages_free": 49}),
        ("negative pages", {"pages_kv": -10, "pages_free": 70}),
        ("zero page size", {"page_bytes": 0}),
        ("negative compute time", {"block_compute_ms": -0.1}),
        ("nan compute time", {"block_compute_ms": float("nan")}),
        ("zero max length", {"max_length": 0}),
        ("unknown state", {"state": "offline"}),
        ("extra field", {"admin": True}),
        ("string for int", {"block_start": "4"}),
        ("bool for int", {"session_count": True}),
        ("float for int", {"pages_total": 100.0}),
        ("int for string", {"dtype": 16}),
        ("map for addrs", {"addrs": {"a": 1}}),
        ("oversized public name", {"public_name": "x" * 65}),
        ("oversized peer id", {"peer_id": "p" * 1000}),
        ("oversized address", {"addrs": ["/ip4/" + "1" * 300]}),
        ("too many addresses", {"addrs": [f"/ip4/127.0.0.1/tcp/{port}" for port in range(17)]}),
        ("empty model id", {"model_id": ""}),
        ("negative sessions_fit", {"sessions_fit": -1}),
        ("decode timings out of order", {"block_decode_ms": [{"batch": 8, "ms": 1.0}, {"batch": 1, "ms": 0.5}]}),
        ("repeated decode batch size", {"block_decode_ms": [{"batch": 1, "ms": 1.0}, {"batch": 1, "ms": 0.5}]}),
        ("decode timing of batch 0", {"block_decode_ms": [{"batch": 0, "ms": 1.0}]}),
        ("negative decode timing", {"block_decode_ms": [{"batch": 1, "ms": -1.0}]}),
        ("too many decode timings", {"block_decode_ms": [{"batch": b, "ms": 1.0} for b in range(1, 10)]}),
        ("restorable start without end", {"restorable_start": 0}),
        ("restorable range not around the served one", {"restorable_start": 5, "restorable_end": 8}),
    ],
)
def test_invalid_record_is_dropped(case: str, overrides: dict[str, Any]) -> None:
    assert ServerRecord.from_wire(make_wire(**overrides)) is None, case


def test_missing_field_is_dropped() -> None:
    wire = make_wire()
    del wire["max_length"]
    assert ServerRecord.from_wire(wire) is None


@pytest.mark.parametrize("garbage", [None, b"\x00garbage", "record", 42, ["peer"], {1: 2}])
def test_non_record_values_are_dropped(garbage: object) -> None:
    assert ServerRecord.from_wire(garbage) is None


def test_a_dropped_servers_record_carries_the_range_it_can_restore() -> None:
    wire = make_wire(restorable_start=0, restorable_end=30)
    record = ServerRecord.from_wire(wire)
    assert record is not None and (record.restorable_start, record.restorable_end) == (0, 30)
    assert ServerRecord.from_wire(make_wire()).restorable_start is None  # type: ignore[union-attr]
