"""Frames (length-prefixed msgpack maps) and tensors as plain maps, with the size checks a receiver needs.

A frame is a 4-byte big-endian unsigned body length followed by a msgpack body that must be a map.
A tensor crosses the wire as ``{"dtype": "float32", "shape": [2, 3], "data": b"..."}`` with the raw
little-endian element bytes in row-major order.
"""

from __future__ import annotations

import asyncio
import math
import sys
from typing import Any

import msgpack
import torch

from swarm.errors import FrameTooLarge, InvalidTensor, MalformedFrame, UnknownCompression

DEFAULT_MAX_FRAME_BYTES = 64 * 2**20
HEADER_BYTES = 4
_MAX_BODY_BYTES = 2 ** (8 * HEADER_BYTES) - 1
MAX_TENSOR_DIMS = 8
MAX_STEPS_PER_FRAME = 256  # step payloads one `steps` call or `push` frame may carry

COMPRESSIONS: tuple[str | None, ...] = (None, "fp16", "bf16")
_COMPRESSED_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# Names on the wire are stable strings; torch's own names ("torch.float32") would tie the format to torch.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}
_TENSOR_KEYS = frozenset({"dtype", "shape", "data"})

# Tensor bytes are sent as they lie in memory; every platform torch ships CPU wheels for is little-endian.
assert sys.byteorder == "little", "swarm.wire assumes a little-endian host"


class StreamClosed(Exception):
    """The peer closed the byte stream (EOF or reset) before a whole frame arrived.

    Not a `SwarmError`: it never crosses the wire, it tells the local reader that the stream is gone.
    """


# ---------------------------------------------------------------------------------------------- frames


def pack_frame(message: dict[str, Any], *, max_bytes: int | None = None) -> bytes:
    """Gives the header and msgpack body of `message`; raises FrameTooLarge if the body exceeds `max_bytes`."""
    if not isinstance(message, dict):
        raise TypeError(f"a frame must be a dict, got {type(message).__name__}")
    body = msgpack.packb(message, use_bin_type=True)
    limit = _MAX_BODY_BYTES if max_bytes is None else min(max_bytes, _MAX_BODY_BYTES)
    if len(body) > limit:
        raise FrameTooLarge(f"frame body of {len(body)} bytes exceeds the limit of {limit} bytes")
    return len(body).to_bytes(HEADER_BYTES, "big") + body


def unpack_body(body: bytes) -> dict[str, Any]:
    """Gives the map a frame body holds; raises MalformedFrame if it is not valid msgpack or not a map."""
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for corrupt input; all mean the same here
        raise MalformedFrame(f"frame body of {len(body)} bytes is not valid msgpack ({type(e).__name__}: {e})") from e
    if not isinstance(message, dict):
        raise MalformedFrame(f"frame body must be a msgpack map, got {type(message).__name__}")
    return message


async def write_frame(writer: asyncio.StreamWriter, message: dict[str, Any], *, max_bytes: int | None = None) -> None:
    """Sends one frame and waits until the transport accepted it (flow control)."""
    writer.write(pack_frame(message, max_bytes=max_bytes))
    await writer.drain()


async def read_frame_header(reader: asyncio.StreamReader, max_bytes: int) -> int:
    """Gives the body length of the next frame; raises FrameTooLarge (body left unread) or StreamClosed."""
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise StreamClosed("stream closed before a frame header") from e
    body_bytes = int.from_bytes(header, "big")
    if body_bytes > max_bytes:
        raise FrameTooLarge(f"frame body of {body_bytes} bytes exceeds the limit of {max_bytes} bytes")
    return body_bytes


async def read_frame_body(reader: asyncio.StreamReader, body_bytes: int) -> bytes:
    """Gives the `body_bytes` raw bytes of a frame body; raises StreamClosed if the stream ends first."""
    try:
        return await reader.readexactly(body_bytes)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise StreamClosed(f"stream closed inside a frame body of {body_bytes} bytes") from e


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> dict[str, Any]:
    """Gives the next frame's map.

    Raises FrameTooLarge before reading a body over `max_bytes` (the stream cannot be resynchronised after it),
    MalformedFrame if the body is not a msgpack map (the stream stays in sync), StreamClosed on EOF or reset.
    """
    body_bytes = await read_frame_header(reader, max_bytes)
    return unpack_body(await read_frame_body(reader, body_bytes))


# --------------------------------------------------------------------------------------------- tensors


def field(payload: dict[str, Any], name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """Gives payload[name] of a request if it has the expected type; raises MalformedFrame naming the field
    otherwise."""
    if name not in payload:
        if optional:
            return None
        raise MalformedFrame(f"request field {name!r} is missing")
    value = payload[name]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise MalformedFrame(f"request field {name!r} has type {type(value).__name__}, expected {kind}")
    return value


def validate_compression(name: str | None) -> str | None:
    """Gives the canonical compression name (None, "fp16" or "bf16"); "none" and "" mean None."""
    if name is None or name in ("", "none"):
        return None
    if name not in _COMPRESSED_DTYPES:
        raise UnknownCompression(f"unknown compression {name!r:.60}; expected one of none, fp16, bf16")
    return name


def encode_tensor(tensor: torch.Tensor, compression: str | None = None) -> dict[str, Any]:
    """Gives the wire map of `tensor`; with a compression, floating tensors travel as float16 or bfloat16."""
    compression = validate_compression(compression)
    tensor = tensor.detach().cpu()
    if compression is not None and tensor.is_floating_point():
        tensor = tensor.to(_COMPRESSED_DTYPES[compression])
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise InvalidTensor(f"dtype {tensor.dtype} cannot be sent; supported: {', '.join(WIRE_DTYPES)}")
    if tensor.dim() > MAX_TENSOR_DIMS:
        raise InvalidTensor(f"tensor has {tensor.dim()} dims; at most {MAX_TENSOR_DIMS} can be sent")
    # A uint8 view gives the raw bytes of any dtype, bfloat16 included, which numpy cannot represent.
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": name, "shape": list(tensor.shape), "data": data}


def decode_tensor(obj: object, *, dtype: torch.dtype | None = None, max_elements: int | None = None) -> torch.Tensor:
    """Gives the tensor a wire map describes (a fresh, writable copy), cast to `dtype` if one is given.

    Raises InvalidTensor naming what was expected and what came for any malformed map.
    """
    if not isinstance(obj, dict):
        raise InvalidTensor(f"a tensor must be a map with keys dtype, shape, data; got {type(obj).__name__}")
    if set(obj) != _TENSOR_KEYS:
        raise InvalidTensor(f"a tensor map must have exactly the keys data, dtype, shape; got {sorted(map(str, obj))}")
    dtype_name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    wire_dtype = WIRE_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if wire_dtype is None:
        raise InvalidTensor(
            f"tensor dtype {dtype_name!r:.50} is not supported; expected one of {', '.join(WIRE_DTYPES)}"
        )
    if not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS:
        raise InvalidTensor(f"tensor shape must be a list of at most {MAX_TENSOR_DIMS} ints; got {shape!r:.100}")
    if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape):
        raise InvalidTensor(f"tensor shape must hold non-negative ints; got {shape!r:.100}")
    if not isinstance(data, bytes):
        raise InvalidTensor(f"tensor data must be bytes; got {type(data).__name__}")
    numel = math.prod(shape)
    if max_elements is not None and numel > max_elements:
        raise InvalidTensor(
            f"tensor of shape {shape} has {numel} elements; this receiver accepts at most {max_elements}"
        )
    itemsize = wire_dtype.itemsize
    if len(data) != numel * itemsize:
        raise InvalidTensor(
            f"tensor of shape {shape} and dtype {dtype_name} needs {numel * itemsize} bytes of data; got {len(data)}"
        )
    if numel == 0:
        tensor = torch.empty(shape, dtype=wire_dtype)  # frombuffer rejects empty buffers
    else:
        # The bytearray copy makes the tensor own writable memory (frombuffer on bytes would alias read-only data).
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if wire_dtype == torch.bool and int(raw.max()) > 1:
            raise InvalidTensor("bool tensor data must hold only 0 and 1 bytes")
        tensor = raw.view(wire_dtype).reshape(shape)
    return tensor if dtype is None else tensor.to(dtype)
