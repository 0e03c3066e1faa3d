"""Property-based fuzzing of what reads untrusted bytes and maps: the frame decoder, tensors on the wire, DHT records
(as a lookup sees them) and `swarm-sim` specs. Each gives a value or its typed error, never another exception."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.spec import SwarmSpecError, parse_swarm_spec
from swarm.dht import _valid_records
from swarm.errors import FrameTooLarge, InvalidTensor, MalformedFrame
from swarm.records import NextHop, OrchestratorRecord, ServerRecord
from swarm.wire import HEADER_BYTES, StreamClosed, decode_tensor, read_frame, unpack_body

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=30)),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=5)),
    max_leaves=25,
)
wire_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
              st.text(max_size=30), st.binary(max_size=30)),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=16), inner, max_size=6)),
    max_leaves=25,
)
RECORD_FIELDS = list(ServerRecord.model_fields)


@settings(max_examples=500, deadline=None)
@given(body=st.one_of(st.binary(max_size=256), wire_values.map(lambda v: msgpack.packb(v, use_bin_type=True))))
def test_a_frame_body_decodes_to_a_map_or_a_malformed_frame(body: bytes) -> None:
    try:
        assert isinstance(unpack_body(body), dict)
    except MalformedFrame:
        pass


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64), declared=st.integers(0, 2**32 - 1))
def test_a_stream_of_junk_gives_a_frame_or_a_typed_error(raw: bytes, declared: int) -> None:
    async def read() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(declared.to_bytes(HEADER_BYTES, "big") + raw)
        reader.feed_eof()
        try:
            assert isinstance(await read_frame(reader, 1 << 16), dict)
        except (MalformedFrame, FrameTooLarge, StreamClosed):
            pass

    asyncio.run(read())


@settings(max_examples=500, deadline=None)
@given(obj=st.one_of(wire_values, st.fixed_dictionaries({
    "dtype": st.sampled_from(["float32", "float16", "bfloat16", "int64", "bool", "uint8", "x"]),
    "shape": st.lists(st.integers(-3, 2**40), max_size=5), "data": st.binary(max_size=64)})))
def test_a_tensor_map_decodes_or_raises_invalid_tensor(obj: Any) -> None:
    try:
        decode_tensor(obj, max_elements=1 << 20)
    except InvalidTensor:
        pass


@settings(max_examples=500, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(RECORD_FIELDS), wire_values, max_size=len(RECORD_FIELDS)),
       subkey=st.one_of(st.text(max_size=20), st.integers(), st.binary(max_size=8)))
def test_a_record_from_the_dht_is_kept_only_if_it_validates_and_any_junk_is_dropped(fields: dict, subkey: Any) -> None:
    for parse in (ServerRecord.from_wire, OrchestratorRecord.from_wire):
        assert parse(fields) is None or isinstance(parse(fields), ServerRecord | OrchestratorRecord)
    kept = _valid_records("model", 0, {subkey: fields, "junk": b"\x00", 7: [fields]})
    assert all(isinstance(record, ServerRecord) and record.peer_id == peer for peer, record in kept.items())
    try:
        NextHop.list_from_wire([fields])
    except ValueError:
        pass


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(json_values, st.fixed_dictionaries(
    {"model": st.one_of(json_values, st.fixed_dictionaries({"name": st.text(max_size=10),
                                                            "num_blocks": st.integers(-2, 100)})),
     "servers": st.lists(json_values, max_size=4)})))
def test_a_swarm_spec_parses_or_raises_its_typed_error(data: Any) -> None:
    try:
        parse_swarm_spec(json.loads(json.dumps(data, allow_nan=True)))
    except SwarmSpecError:
        pass
