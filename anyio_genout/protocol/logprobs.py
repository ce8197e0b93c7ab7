"""Logprobs and sampling masks: numpy arrays plus lazy per-position views.

Sample logprobs travel as ``[token_ids[rows, cols], logprobs[rows, cols], ranks[rows],
cu_num_generated_tokens]`` (vLLM's ``LogprobsLists``), prompt logprobs as the same with a fifth
element (``LogprobsTensors``). Column 0 is the sampled (or prompt) token with its true rank;
column ``j > 0`` is the ``j``-th most likely token, so its rank is ``j``.

A sampling mask is CSR: ``[token_ids, offsets | None, cu_num_generated_tokens]``; row ``i`` is
``token_ids[offsets[i]:offsets[i+1]]`` (no offsets: a single row).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, overload

import attrs
import numpy as np

from ..errors import ProtocolError
from .arrays import AuxFrames, decode_array, encode_array

__all__ = [
    "LogprobEntry",
    "LogprobPosition",
    "Logprobs",
    "SamplingMask",
    "decode_logprobs",
    "decode_sampling_mask",
    "encode_logprobs",
    "encode_sampling_mask",
]


class LogprobEntry(NamedTuple):
    """One candidate token at one position."""

    token_id: int
    logprob: float
    rank: int


@attrs.frozen
class LogprobPosition(Sequence[LogprobEntry]):
    """The candidates at one position: entry 0 is the sampled token, then the top-k."""

    _logprobs: Logprobs
    _row: int

    @property
    def entries(self) -> list[LogprobEntry]:
        return list(self)

    @property
    def sampled(self) -> LogprobEntry:
        return self[0]

    def __len__(self) -> int:
        return int(self._logprobs.token_ids.shape[1])

    @overload
    def __getitem__(self, index: int) -> LogprobEntry: ...
    @overload
    def __getitem__(self, index: slice) -> list[LogprobEntry]: ...
    def __getitem__(self, index: int | slice) -> LogprobEntry | list[LogprobEntry]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        cols = len(self)
        if index < 0:
            index += cols
        if not 0 <= index < cols:
            raise IndexError(index)
        lp = self._logprobs
        rank = int(lp.ranks[self._row]) if index == 0 else index
        return LogprobEntry(
            int(lp.token_ids[self._row, index]), float(lp.logprobs[self._row, index]), rank
        )

    def __iter__(self) -> Iterator[LogprobEntry]:
        for i in range(len(self)):
            yield self[i]


@attrs.frozen(eq=False)
class Logprobs:
    """Logprobs for ``len(self)`` positions, as numpy arrays (no copy of the wire bytes)."""

    token_ids: np.ndarray[Any, Any]
    logprobs: np.ndarray[Any, Any]
    ranks: np.ndarray[Any, Any]

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def positions(self) -> Sequence[LogprobPosition]:
        return [LogprobPosition(self, i) for i in range(len(self))]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Logprobs):
            return NotImplemented
        return (
            np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.logprobs, other.logprobs, equal_nan=True)
            and np.array_equal(self.ranks, other.ranks)
        )

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def concat(cls, parts: Sequence[Logprobs]) -> Logprobs | None:
        """Stack several steps' logprobs (same column count) into one."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return cls(
            np.concatenate([p.token_ids for p in parts]),
            np.concatenate([p.logprobs for p in parts]),
            np.concatenate([p.ranks for p in parts]),
        )


def decode_logprobs(value: object, frames: AuxFrames, where: str) -> Logprobs | None:
    """Decode ``LogprobsLists``/``LogprobsTensors``; ``None`` for nil or zero rows."""
    if value is None:
        return None
    if type(value) is not list or not 3 <= len(value) <= 5:
        raise ProtocolError(f"{where}: expected [token_ids, logprobs, ranks, cu_num, ...]")
    if any(v is not None for v in value[3:]):
        raise ProtocolError(f"{where}.cu_num_generated_tokens: must be nil in a per-request "
                            f"output")
    ids = decode_array(value[0], frames, f"{where}.token_ids")
    lps = decode_array(value[1], frames, f"{where}.logprobs")
    ranks = decode_array(value[2], frames, f"{where}.ranks")
    if ids.ndim != 2 or lps.shape != ids.shape or ranks.shape != ids.shape[:1]:
        raise ProtocolError(
            f"{where}: inconsistent shapes token_ids {ids.shape}, logprobs {lps.shape}, "
            f"ranks {ranks.shape}"
        )
    if ids.dtype.kind not in "iu" or ranks.dtype.kind not in "iu" or lps.dtype.kind != "f":
        raise ProtocolError(f"{where}: token ids and ranks must be integers, logprobs floats")
    if ids.shape[0] == 0:
        return None
    if ids.shape[1] == 0:
        raise ProtocolError(f"{where}: {ids.shape[0]} positions with zero columns")
    if ids.size and int(ids.min()) < 0:
        raise ProtocolError(f"{where}.token_ids: negative token id")
    if int(ranks.min()) < 1:
        raise ProtocolError(f"{where}.ranks: a sampled token's rank must be at least 1")
    return Logprobs(ids, lps, ranks)


def encode_logprobs(value: Logprobs, aux: list[bytes | memoryview] | None, *,
                    prompt: bool = False) -> list[Any]:
    """Encode as vLLM does: numpy dtype strings for sample logprobs, torch names for prompt."""
    if prompt:
        return [
            encode_array(value.token_ids.astype(np.int32), aux, dtype_name="int32"),
            encode_array(value.logprobs.astype(np.float32), aux, dtype_name="float32"),
            encode_array(value.ranks.astype(np.int32), aux, dtype_name="int32"),
            None,
            None,
        ]
    return [
        encode_array(value.token_ids.astype("<i4"), aux),
        encode_array(value.logprobs.astype("<f4"), aux),
        encode_array(value.ranks.astype("<i8"), aux),
        None,
    ]


@attrs.frozen(eq=False)
class SamplingMask:
    """The token ids kept by sampling at each position (CSR)."""

    token_ids: np.ndarray[Any, Any]
    offsets: np.ndarray[Any, Any] | None = None

    @property
    def rows(self) -> list[list[int]]:
        ids = self.token_ids.tolist()
        if self.offsets is None:
            return [ids]
        off = self.offsets.tolist()
        return [ids[off[i]:off[i + 1]] for i in range(len(off) - 1)]

    def __len__(self) -> int:
        return 1 if self.offsets is None else int(self.offsets.shape[0]) - 1

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingMask):
            return NotImplemented
        return self.rows == other.rows

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def concat(cls, parts: Sequence[SamplingMask]) -> SamplingMask | None:
        """Stack several steps' masks into one, row after row (None for no parts)."""
        if len(parts) < 2:
            return parts[0] if parts else None
        offsets = [np.zeros(1, dtype=np.int64)]
        base = 0
        for part in parts:
            own = (np.array([0, part.token_ids.shape[0]], dtype=np.int64)
                   if part.offsets is None else part.offsets.astype(np.int64))
            offsets.append(own[1:] - own[0] + base)
            base += int(own[-1] - own[0])
        ids = np.concatenate([p.token_ids[int(p.offsets[0]):int(p.offsets[-1])]
                              if p.offsets is not None else p.token_ids for p in parts])
        return cls(ids, np.concatenate(offsets))


def decode_sampling_mask(value: object, frames: AuxFrames, where: str) -> SamplingMask | None:
    if value is None:
        return None
    if type(value) is not list or not 1 <= len(value) <= 3:
        raise ProtocolError(f"{where}: expected [token_ids, offsets, cu_num]")
    value = value + [None] * (3 - len(value))
    if value[2] is not None:
        raise ProtocolError(f"{where}.cu_num_generated_tokens: must be nil in an output")
    ids = decode_array(value[0], frames, f"{where}.token_ids")
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ProtocolError(f"{where}.token_ids: expected a 1-d integer array")
    if ids.size and int(ids.min()) < 0:
        raise ProtocolError(f"{where}.token_ids: negative token id")
    offsets = None
    if value[1] is not None:
        offsets = decode_array(value[1], frames, f"{where}.offsets")
        if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or offsets.shape[0] < 1:
            raise ProtocolError(f"{where}.offsets: expected a non-empty 1-d integer array")
        diffs = np.diff(offsets.astype(np.int64))
        if int(offsets[0]) != 0 or int(offsets[-1]) != ids.shape[0] or (
            diffs.size and int(diffs.min()) < 0
        ):
            raise ProtocolError(
                f"{where}.offsets: must start at 0, never decrease and end at "
                f"{ids.shape[0]}"
            )
    return SamplingMask(ids, offsets)


def encode_sampling_mask(mask: SamplingMask, aux: list[bytes | memoryview] | None) -> list[Any]:
    offsets = None if mask.offsets is None else encode_array(mask.offsets.astype("<i8"), aux)
    return [encode_array(mask.token_ids.astype("<i4"), aux), offsets, None]
