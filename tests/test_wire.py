"""Frames and tensors: round trips, compression, and every way a receiver refuses bad input."""

from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest
import torch

from swarm.errors import FrameTooLarge, InvalidTensor, MalformedFrame
from swarm.wire import (
    COMPRESSIONS,
    HEADER_BYTES,
    StreamClosed,
    decode_tensor,
    encode_tensor,
    pack_frame,
    read_frame,
    unpack_body,
    validate_compression,
    write_frame,
)

pytestmark = pytest.mark.timeout(60)


def _fed_reader(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def _via_wire(obj: dict) -> dict:
    """Gives `obj` after a msgpack round trip, as a receiver sees it."""
    return unpack_body(msgpack.packb(obj, use_bin_type=True))


# ---------------------------------------------------------------------------------------------- tensors

ROUND_TRIP_CASES = [
    torch.randn(2, 3, 4),
    torch.randn(5, dtype=torch.float64),
    torch.randn(3, 3).to(torch.float16),
    torch.randn(4, 2).to(torch.bfloat16),
    torch.arange(12, dtype=torch.int64).reshape(3, 4),
    torch.arange(-5, 5, dtype=torch.int32),
    torch.tensor([True, False, True]),
    torch.arange(256, dtype=torch.uint8),
    torch.tensor(3.5),  # zero-dim
    torch.empty(0, 7),
    torch.empty(2, 0, 3, dtype=torch.int64),
    torch.randn(4, 6).t(),  # non-contiguous
    torch.randn(2, 8, 3)[:, ::2, 1:],  # strided slice with a storage offset
]


@pytest.mark.parametrize("tensor", ROUND_TRIP_CASES, ids=lambda t: f"{t.dtype}-{list(t.shape)}-c{t.is_contiguous()}")
def test_tensor_round_trip_keeps_dtype_shape_and_values(tensor: torch.Tensor) -> None:
    decoded = decode_tensor(_via_wire(encode_tensor(tensor)))
    assert decoded.dtype == tensor.dtype
    assert decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_decoded_tensor_is_writable_and_owns_its_memory() -> None:
    wire = _via_wire(encode_tensor(torch.zeros(4)))
    decoded = decode_tensor(wire)
    decoded += 1  # would fail or warn on a read-only buffer
    assert torch.equal(decoded, torch.ones(4))
    assert torch.equal(decode_tensor(wire), torch.zeros(4))


@pytest.mark.parametrize(("compression", "wire_dtype", "atol"), [("fp16", "float16", 1e-2), ("bf16", "bfloat16", 5e-2)])
def test_compressed_transport_restores_compute_dtype(compression: str, wire_dtype: str, atol: float) -> None:
    hidden = torch.randn(2, 5, 16)
    wire = encode_tensor(hidden, compression)
    assert wire["dtype"] == wire_dtype
    assert len(wire["data"]) == hidden.numel() * 2
    restored = decode_tensor(_via_wire(wire), dtype=torch.float32)
    assert restored.dtype == torch.float32
    torch.testing.assert_close(restored, hidden, atol=atol, rtol=atol)


def test_compression_leaves_integer_tensors_alone() -> None:
    token_ids = torch.tensor([[1, 2, 3]])
    wire = encode_tensor(token_ids, "fp16")
    assert wire["dtype"] == "int64"
    assert torch.equal(decode_tensor(wire), token_ids)


def test_compression_names_are_validated() -> None:
    assert COMPRESSIONS == (None, "fp16", "bf16")
    assert [validate_compression(name) for name in (None, "none", "", "fp16", "bf16")] == [
        None,
        None,
        None,
        "fp16",
        "bf16",
    ]
    with pytest.raises(ValueError, match="int8") as unknown:
        validate_compression("int8")
    assert isinstance(unknown.value, MalformedFrame)  # a typed error for a request that names it
    with pytest.raises(ValueError):
        encode_tensor(torch.zeros(1), "fp8")


def _good_wire() -> dict:
    return _via_wire(encode_tensor(torch.zeros(2, 3)))


INVALID_CASES = {
    "not a map": ([1, 2, 3], "must be a map"),
    "missing key": ({"dtype": "float32", "shape": [1]}, "exactly the keys"),
    "extra key": ({**_good_wire(), "device": "cuda"}, "exactly the keys"),
    "unknown dtype": ({**_good_wire(), "dtype": "complex64"}, "complex64"),
    "dtype not a str": ({**_good_wire(), "dtype": 7}, "not supported"),
    "shape not a list": ({**_good_wire(), "shape": "2x3"}, "list"),
    "negative dim": ({**_good_wire(), "shape": [-2, -3]}, "non-negative"),
    "float dim": ({**_good_wire(), "shape": [2.0, 3]}, "non-negative ints"),
    "bool dim": ({**_good_wire(), "shape": [True, 6]}, "non-negative ints"),
    "too many dims": ({"dtype": "float32", "shape": [1] * 9, "data": b"\0" * 4}, "at most 8"),
    "data not bytes": ({**_good_wire(), "data": "abc"}, "bytes"),
    "short data": ({**_good_wire(), "data": b"\0" * 23}, "needs 24 bytes"),
    "long data": ({**_good_wire(), "data": b"\0" * 25}, "got 25"),
    "huge shape": ({**_good_wire(), "shape": [2**40, 2**40]}, "needs"),
    "bool bytes not 0/1": ({"dtype": "bool", "shape": [2], "data": b"\x00\x07"}, "0 and 1"),
}


@pytest.mark.parametrize("case", INVALID_CASES, ids=str)
def test_invalid_tensor_maps_are_refused_with_an_actionable_message(case: str) -> None:
    obj, expected_text = INVALID_CASES[case]
    with pytest.raises(InvalidTensor, match=expected_text):
        decode_tensor(obj)


def test_tensor_over_max_elements_is_refused() -> None:
    wire = _good_wire()
    assert decode_tensor(wire, max_elements=6).shape == (2, 3)
    with pytest.raises(InvalidTensor, match="at most 5"):
        decode_tensor(wire, max_elements=5)


# ----------------------------------------------------------------------------------------------- frames


def test_frame_round_trip_keeps_bytes_ints_and_nesting() -> None:
    message = {"id": 7, "method": "step", "payload": {"blob": b"\x00\xff", "text": "é", 3: [1.5, None, True]}}

    async def scenario() -> None:
        left, right = socket.socketpair()
        # Both pairs are kept: a StreamWriter that is garbage-collected closes its socket.
        reader, left_writer = await asyncio.open_connection(sock=left)
        _right_reader, writer = await asyncio.open_connection(sock=right)
        try:
            await write_frame(writer, message)
            await write_frame(writer, {"second": 2})
            assert await read_frame(reader, max_bytes=1024) == message
            assert await read_frame(reader, max_bytes=1024) == {"second": 2}
            writer.close()
            with pytest.raises(StreamClosed):
                await read_frame(reader, max_bytes=1024)
        finally:
            writer.close()
            left_writer.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_frame_too_large_is_raised_before_the_body_is_read() -> None:
    async def scenario() -> None:
        # Only the header is available and the stream stays open: reading the body would hang.
        reader = _fed_reader((10**6).to_bytes(HEADER_BYTES, "big"), eof=False)
        with pytest.raises(FrameTooLarge, match="1000000 bytes exceeds the limit of 1024"):
            await asyncio.wait_for(read_frame(reader, max_bytes=1024), 5)

    asyncio.run(scenario())


def test_pack_frame_refuses_a_body_over_the_limit() -> None:
    assert len(pack_frame({"blob": b"x" * 100}, max_bytes=200)) > 100
    with pytest.raises(FrameTooLarge):
        pack_frame({"blob": b"x" * 300}, max_bytes=200)


@pytest.mark.parametrize(
    ("body", "expected_text"),
    [
        (b"\xc1\xc1\xc1", "not valid msgpack"),  # 0xc1 is never used in msgpack
        (b"\x92\x01", "not valid msgpack"),  # truncated array
        (msgpack.packb({"a": 1}) + b"\x01", "not valid msgpack"),  # trailing bytes
        (msgpack.packb([1, 2, 3]), "got list"),
        (msgpack.packb("text"), "got str"),
    ],
)
def test_malformed_frame_bodies_are_refused(body: bytes, expected_text: str) -> None:
    async def scenario() -> None:
        reader = _fed_reader(len(body).to_bytes(HEADER_BYTES, "big") + body + pack_frame({"next": 1}))
        with pytest.raises(MalformedFrame, match=expected_text):
            await read_frame(reader, max_bytes=1024)
        # The whole body was consumed, so the stream is still in sync.
        assert await read_frame(reader, max_bytes=1024) == {"next": 1}

    asyncio.run(asyncio.wait_for(scenario(), 5))


@pytest.mark.parametrize("data", [b"", b"\x00\x00", b"\x00\x00\x00\x05ab"], ids=["empty", "half-header", "half-body"])
def test_eof_inside_a_frame_is_stream_closed(data: bytes) -> None:
    async def scenario() -> None:
        with pytest.raises(StreamClosed):
            await read_frame(_fed_reader(data), max_bytes=1024)

    asyncio.run(asyncio.wait_for(scenario(), 5))
