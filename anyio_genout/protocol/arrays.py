"""Numeric arrays on the wire: ``[dtype, shape, data]``.

vLLM's msgpack encoder writes numpy arrays and torch tensors as a three-element array. ``dtype``
is a numpy type string (``"<i4"``, ``">f8"``) or a torch type name (``"int32"``,
``"bfloat16"``); ``shape`` is a list of sizes; ``data`` is either msgpack extension type 3 (the
raw little- or big-endian bytes inline) or an integer: the index of the multipart frame that
carries the bytes (frame 0 is the main msgpack frame, so indices start at 1). Arrays smaller than
:data:`INLINE_THRESHOLD` bytes travel inline, larger ones as extra ("aux") frames.

Extension types 1 and 2 are pickle and cloudpickle: refused, never deserialised.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Any, Final

import msgpack
import numpy as np

from ..errors import ProtocolError

__all__ = [
    "EXT_CLOUDPICKLE",
    "EXT_PICKLE",
    "EXT_RAW_VIEW",
    "INLINE_THRESHOLD",
    "AuxFrames",
    "MAX_NDIM",
    "decode_array",
    "describe",
    "encode_array",
    "resolve_dtype",
]

#: msgpack extension codes used by vLLM's ``MsgpackEncoder``.
EXT_PICKLE: Final = 1
EXT_CLOUDPICKLE: Final = 2
EXT_RAW_VIEW: Final = 3

#: ``VLLM_MSGPACK_ZERO_COPY_THRESHOLD``: arrays of at least this many bytes go in aux frames.
INLINE_THRESHOLD: Final = 256
#: Most dimensions a wire array may declare (numpy itself stops at 32 or 64, by version).
MAX_NDIM: Final = 32
#: Largest size of one dimension; also bounds the element count of an empty array.
_MAX_DIM: Final = 2**40

# torch dtype names as vLLM writes them for tensors -> numpy dtype. bfloat16 has no numpy
# dtype: its bits are carried as uint16 and widened to float32 on decode (lossless).
_TORCH_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "bool": np.dtype("?"),
    "uint8": np.dtype("<u1"),
    "int8": np.dtype("<i1"),
    "int16": np.dtype("<i2"),
    "uint16": np.dtype("<u2"),
    "int32": np.dtype("<i4"),
    "uint32": np.dtype("<u4"),
    "int64": np.dtype("<i8"),
    "uint64": np.dtype("<u8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "complex64": np.dtype("<c8"),
    "complex128": np.dtype("<c16"),
    "bfloat16": np.dtype("<u2"),
}


def _numpy_dtypes() -> dict[str, np.dtype[Any]]:
    # The strings numpy's ``dtype.str`` gives for the numeric types: "|" for one-byte types,
    # "<" or ">" otherwise (one-byte types also accept "<" and ">", which numpy parses).
    # A fixed table, so a peer's string never reaches numpy's dtype parser.
    table: dict[str, np.dtype[Any]] = {}
    for code, orders in (("b1", "|<>"), ("i1", "|<>"), ("u1", "|<>"), ("i2", "<>"), ("i4", "<>"),
                         ("i8", "<>"), ("u2", "<>"), ("u4", "<>"), ("u8", "<>"), ("f2", "<>"),
                         ("f4", "<>"), ("f8", "<>"), ("c8", "<>"), ("c16", "<>")):
        for order in orders:
            table[order + code] = np.dtype(order + code)
    return table


#: Every dtype string the decoder accepts: numpy ``dtype.str`` values and torch names.
_WIRE_DTYPES: Final[dict[str, np.dtype[Any]]] = {**_numpy_dtypes(), **_TORCH_DTYPES}

#: The frames of one multipart message; index 0 is the main msgpack frame.
AuxFrames = Sequence[bytes | bytearray | memoryview]


def resolve_dtype(name: object, where: str = "array") -> np.dtype[Any]:
    """Return the numpy dtype for a wire dtype string, or raise :class:`ProtocolError`."""
    if type(name) is not str:
        raise ProtocolError(f"{where}.dtype: expected a string, got {type(name).__name__}")
    dtype = _WIRE_DTYPES.get(name)
    if dtype is None:
        raise ProtocolError(f"{where}.dtype: unsupported dtype {describe(name)}")
    return dtype


def decode_array(value: object, frames: AuxFrames, where: str = "array") -> np.ndarray[Any, Any]:
    """Decode a wire ``[dtype, shape, data]`` into a read-only numpy array.

    The array shares memory with the frame or extension payload that carries it (no copy),
    except bfloat16, which is widened to float32. ``where`` names the field for error messages.
    """
    if type(value) is not list or len(value) != 3:
        raise ProtocolError(f"{where}: expected [dtype, shape, data], got {describe(value)}")
    name, shape, data = value
    dtype = resolve_dtype(name, where)
    if type(shape) is not list or len(shape) > MAX_NDIM \
            or not all(type(n) is int and 0 <= n < _MAX_DIM for n in shape):
        raise ProtocolError(f"{where}.shape: expected a list of at most {MAX_NDIM} sizes, "
                            f"got {describe(shape)}")
    count = 1
    nonzero = 1
    for n in shape:
        count *= n
        nonzero *= n or 1
    if nonzero >= _MAX_DIM:
        # numpy refuses even an empty array whose other dimensions overflow its size type.
        raise ProtocolError(f"{where}.shape: {shape} is too large")
    expected = count * dtype.itemsize
    buffer: bytes | bytearray | memoryview
    if isinstance(data, msgpack.ExtType):
        if data.code != EXT_RAW_VIEW:
            raise ProtocolError(f"{where}.data: unsupported msgpack extension type {data.code}")
        buffer = data.data
    elif type(data) is int:
        if not 1 <= data < len(frames):
            raise ProtocolError(
                f"{where}.data: aux frame index {data} out of range (message has "
                f"{len(frames)} frames)"
            )
        buffer = frames[data]
    else:
        raise ProtocolError(f"{where}.data: expected raw bytes or a frame index, got "
                            f"{describe(data)}")
    size = buffer.nbytes if isinstance(buffer, memoryview) else len(buffer)
    if size != expected:
        raise ProtocolError(
            f"{where}: {name} shape {describe(shape)} needs {expected} bytes, the data has "
            f"{size}"
        )
    array = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    if name == "bfloat16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
        array.flags.writeable = False
    return array


def encode_array(
    array: np.ndarray[Any, Any],
    aux: list[bytes | memoryview] | None,
    *,
    dtype_name: str | None = None,
) -> list[Any]:
    """Encode ``array`` as ``[dtype, shape, data]`` the way vLLM does.

    Arrays of at least :data:`INLINE_THRESHOLD` bytes are appended to ``aux`` (the message's
    frame list, whose element 0 is the main frame) and referenced by index; smaller ones, and
    all arrays when ``aux`` is None, travel inline as extension type 3. ``dtype_name`` writes a
    torch-style name (``"int32"``) instead of the numpy string; ``"bfloat16"`` truncates float
    values to bfloat16.
    """
    if dtype_name == "bfloat16":
        bits = np.asarray(array, dtype=np.float32).view(np.uint32) >> 16
        array = np.asarray(bits, dtype="<u2")
    else:
        array = np.asarray(array)
    if not array.flags.c_contiguous:
        # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
        array = array.copy(order="C")
    data: memoryview = array.data.cast("B") if array.size else memoryview(b"")
    name = dtype_name if dtype_name is not None else array.dtype.str
    ref: Any
    if aux is None or array.ndim == 0 or data.nbytes < INLINE_THRESHOLD:
        ref = msgpack.ExtType(EXT_RAW_VIEW, data.tobytes())
    else:
        ref = len(aux)
        aux.append(data)
    return [name, list(array.shape), ref]


_repr = reprlib.Repr()
_repr.maxlevel = 3
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 6
_repr.maxstring = _repr.maxother = _repr.maxlong = 48


def describe(value: object) -> str:
    """A short, bounded description of a decoded wire value for error messages.

    Never builds the full ``repr`` of a peer's value: that could be huge, or nested deeply
    enough to raise :class:`RecursionError`.
    """
    if isinstance(value, bytes | bytearray | memoryview):
        text = f"of {len(value)} bytes"
    elif isinstance(value, msgpack.ExtType):
        text = f"(code {value.code}, {len(value.data)} bytes)"
    else:
        text = _repr.repr(value)
    return f"{type(value).__name__} {text}"
