"""What a generation yields: per-step outputs, finish reasons, and the collected result."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterable, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np

from ..errors import IncompleteStreamError, SamplingMaskMismatchError
from ..protocol import (
    FINISH_REASON_LABELS,
    EngineCoreFinishReason,
    Logprobs,
    SamplingMask,
    finish_reason_label,
)

__all__ = [
    "CollectedGenerateOutput",
    "FinishReason",
    "FinishReasonKind",
    "GenerateOutput",
    "GeneratePromptInfo",
    "TokenUsage",
    "collect_output",
]

StopReason = int | str | tuple[int, ...]


class FinishReasonKind(enum.Enum):
    # The values are the protocol's one list of finish-reason strings (vLLM's).
    STOP = finish_reason_label(EngineCoreFinishReason.STOP)
    LENGTH = finish_reason_label(EngineCoreFinishReason.LENGTH)
    ABORT = finish_reason_label(EngineCoreFinishReason.ABORT)
    ERROR = finish_reason_label(EngineCoreFinishReason.ERROR)
    REPETITION = finish_reason_label(EngineCoreFinishReason.REPETITION)


@attrs.frozen
class FinishReason:
    """Why a request finished. ``stop_reason`` is set for STOP and REPETITION only.

    For STOP it is the stop token id, a string from the engine, the matched stop token
    sequence (a tuple, matched by the client), or None for end-of-sequence.
    """

    kind: FinishReasonKind
    stop_reason: StopReason | None = None

    STOP: ClassVar[FinishReason]
    LENGTH: ClassVar[FinishReason]
    ABORT: ClassVar[FinishReason]
    ERROR: ClassVar[FinishReason]
    REPETITION: ClassVar[FinishReason]

    @classmethod
    def stop(cls, stop_reason: StopReason | None = None) -> FinishReason:
        return cls(FinishReasonKind.STOP, stop_reason)

    @classmethod
    def stop_eos(cls) -> FinishReason:
        """Stopped on the end-of-sequence token."""
        return _STOP_EOS

    @classmethod
    def repetition(cls, stop_reason: StopReason | None = None) -> FinishReason:
        return cls(FinishReasonKind.REPETITION, stop_reason)

    @classmethod
    def from_engine(cls, reason: EngineCoreFinishReason,
                    stop_reason: int | str | None) -> FinishReason:
        if reason is EngineCoreFinishReason.STOP:
            return _STOP_EOS if stop_reason is None else cls(FinishReasonKind.STOP, stop_reason)
        if reason is EngineCoreFinishReason.REPETITION:
            return cls(FinishReasonKind.REPETITION, stop_reason)
        return _SIMPLE[reason]

    def as_str(self) -> str:
        """``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or ``"repetition"``."""
        return self.kind.value

    def __str__(self) -> str:
        if self.stop_reason is None:
            return self.kind.value
        return f"{self.kind.value}({self.stop_reason!r})"


# One kind per engine finish reason, in the same order: a reason added there fails here.
assert tuple(kind.value for kind in FinishReasonKind) == FINISH_REASON_LABELS
_STOP_EOS = FinishReason(FinishReasonKind.STOP)
FinishReason.STOP = _STOP_EOS
FinishReason.LENGTH = FinishReason(FinishReasonKind.LENGTH)
FinishReason.ABORT = FinishReason(FinishReasonKind.ABORT)
FinishReason.ERROR = FinishReason(FinishReasonKind.ERROR)
FinishReason.REPETITION = FinishReason(FinishReasonKind.REPETITION)
_SIMPLE = {
    EngineCoreFinishReason.LENGTH: FinishReason.LENGTH,
    EngineCoreFinishReason.ABORT: FinishReason.ABORT,
    EngineCoreFinishReason.ERROR: FinishReason.ERROR,
}


@attrs.frozen(eq=False)
class GeneratePromptInfo:
    """The prompt, sent with the first output of a request only."""

    prompt_token_ids: tuple[int, ...]
    prompt_logprobs: Logprobs | None = None
    prompt_token_id_logprobs: np.ndarray[Any, Any] | None = None


@attrs.define(eq=False, slots=True)
class GenerateOutput:
    """One step of a generation, or several merged (coalescing, docs/lifecycle.md): the
    tokens new since the previous output (a delta)."""

    request_id: str
    token_ids: list[int]
    prompt_info: GeneratePromptInfo | None = None
    logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    cached_token_count: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    sampling_mask: SamplingMask | None = None
    spec_decode_metrics: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_token_ids(self) -> tuple[int, ...] | None:
        return None if self.prompt_info is None else self.prompt_info.prompt_token_ids

    @property
    def prompt_logprobs(self) -> Logprobs | None:
        return None if self.prompt_info is None else self.prompt_info.prompt_logprobs


@attrs.frozen
class TokenUsage:
    prompt_token_count: int
    output_token_count: int
    cached_token_count: int = 0


@attrs.frozen(eq=False)
class CollectedGenerateOutput:
    """A whole generation, gathered by :func:`collect_output`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: list[int]
    finish_reason: FinishReason
    usage: TokenUsage
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    prompt_token_id_logprobs: np.ndarray[Any, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    sampling_mask: SamplingMask | None = None
    spec_decode_metrics: dict[str, Any] | None = None


async def collect_output(outputs: AsyncIterable[GenerateOutput]) -> CollectedGenerateOutput:
    """Gather every output of one generation; the first error is raised as it arrives.

    Raises :class:`~anyio_genout.IncompleteStreamError` if the outputs end without a terminal
    output, and :class:`~anyio_genout.SamplingMaskMismatchError` if the sampling mask rows do
    not line up with the tokens.
    """
    request_id: str | None = None
    prompt_info: GeneratePromptInfo | None = None
    tokens: list[int] = []
    logprobs: list[Logprobs] = []
    mask_rows: list[list[int]] | None = None
    cached = 0
    async for out in outputs:
        if request_id is None:
            request_id = out.request_id
        if prompt_info is None and out.prompt_info is not None:
            prompt_info = out.prompt_info
        tokens.extend(out.token_ids)
        if out.logprobs is not None:
            logprobs.append(out.logprobs)
        if out.sampling_mask is not None:
            mask_rows = (mask_rows or []) + out.sampling_mask.rows
        cached = max(cached, out.cached_token_count)
        if out.finish_reason is None:
            continue
        mask = None
        if mask_rows is not None:
            if len(mask_rows) != len(tokens):
                raise SamplingMaskMismatchError(
                    f"request {request_id}: sampling mask has {len(mask_rows)} rows for "
                    f"{len(tokens)} tokens")
            mask = _mask_from_rows(mask_rows)
        prompt_ids = prompt_info.prompt_token_ids if prompt_info else ()
        return CollectedGenerateOutput(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            token_ids=tokens,
            finish_reason=out.finish_reason,
            usage=TokenUsage(len(prompt_ids), len(tokens), cached),
            logprobs=Logprobs.concat(logprobs),
            prompt_logprobs=prompt_info.prompt_logprobs if prompt_info else None,
            prompt_token_id_logprobs=(prompt_info.prompt_token_id_logprobs
                                      if prompt_info else None),
            kv_transfer_params=out.kv_transfer_params,
            ec_transfer_params=out.ec_transfer_params,
            sampling_mask=mask,
            spec_decode_metrics=out.spec_decode_metrics,
        )
    raise IncompleteStreamError(
        f"request {request_id or '?'}: the stream ended before its terminal output")


def _mask_from_rows(rows: Sequence[Sequence[int]]) -> SamplingMask:
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    flat = np.array([t for r in rows for t in r], dtype=np.int32)
    return SamplingMask(flat, offsets)
