"""msgpack in and out, with every msgpack failure turned into :class:`ProtocolError`."""

from __future__ import annotations

from typing import Any

import msgpack

from ..errors import ProtocolError
from .arrays import EXT_CLOUDPICKLE, EXT_PICKLE, EXT_RAW_VIEW

__all__ = ["pack", "unpack"]


class _RefusedExtension(Exception):
    pass


def _ext_hook(code: int, data: bytes) -> msgpack.ExtType:
    if code == EXT_RAW_VIEW:
        return msgpack.ExtType(code, data)
    if code in (EXT_PICKLE, EXT_CLOUDPICKLE):
        raise _RefusedExtension(f"pickle extension type {code} refused (never deserialised)")
    raise _RefusedExtension(f"unknown msgpack extension type {code}")


def unpack(data: bytes | bytearray | memoryview, what: str) -> Any:
    """Decode one msgpack value occupying all of ``data``; ``what`` names it in errors."""
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=False, ext_hook=_ext_hook, use_list=True
        )
    except _RefusedExtension as exc:
        raise ProtocolError(f"{what}: {exc}") from None
    except msgpack.ExtraData:
        raise ProtocolError(f"{what}: trailing bytes after the msgpack value") from None
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError, OverflowError) as exc:
        raise ProtocolError(f"{what}: not valid msgpack ({type(exc).__name__}: {exc})") from None



def pack(value: Any) -> bytes:
    """Encode ``value`` (lists, maps, scalars, :class:`msgpack.ExtType`) as msgpack."""
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]
