"""Front end -> engine: the request types and their encoding (ADD, ABORT and UTILITY).

A request message is ``[type byte, msgpack payload, *aux frames]`` (the input ROUTER prepends
the engine identity). ADD carries ``EngineCoreRequest``, a positional array of 22 fields in
vLLM's order; ABORT a list of request ids; UTILITY ``[client_index, call_id, method, args]``.
:meth:`EngineCoreRequest.validate` is the client's request validation (its field checks are
in :mod:`.validation`); the engine side's strict decoding is in :mod:`.request_decode`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import msgpack
import numpy as np

from ..errors import InvalidRequestError
from .packing import pack
from .sampling import SamplingParams, token_ids
from .validation import (
    INT64_MAX,
    INT64_MIN,
    TOKEN_MAX,
    check_arrival_time,
    check_int,
    check_text,
    check_token_ids,
    check_trace_headers,
    resolve_max_tokens,
)

__all__ = [
    "REQUEST_FIELDS",
    "EngineCoreRequest",
    "LoRARequest",
    "RequestType",
    "encode_abort",
    "encode_add",
    "encode_utility",
    "wire_default",
]


class RequestType(bytes, enum.Enum):
    """The first frame of every input-socket message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"


#: ``EngineCoreRequest`` field order (vLLM 0.32/0.33).
REQUEST_FIELDS: Final = (
    "request_id", "prompt_token_ids", "mm_features", "sampling_params", "pooling_params",
    "arrival_time", "lora_request", "cache_salt", "data_parallel_rank", "prompt_embeds",
    "prompt_is_token_ids", "client_index", "current_wave", "priority", "trace_headers",
    "resumable", "external_req_id", "reasoning_ended", "reasoning_parser_kwargs",
    "abort_immediately", "session_id", "kv_hints",
)


@attrs.frozen
class LoRARequest:
    """A LoRA adapter to apply (vLLM's ``LoRARequest``, positional on the wire).

    vLLM refuses (its input thread dies on) an id below 1 and an empty ``lora_path``; the
    client refuses both, and ids beyond int64, before sending.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def to_wire(self) -> list[Any]:
        return [self.lora_name, self.lora_int_id, self.lora_path]


def _prompt_ids(value: Sequence[int]) -> tuple[int, ...]:
    return token_ids(value, "prompt_token_ids")


@attrs.frozen(kw_only=True)
class EngineCoreRequest:
    """One generation request as the engine sees it (token ids in, n=1).

    ``prompt_token_ids`` may be any sequence of ints, or a 1-d numpy integer array (converted
    once, to Python ints); numpy integer scalars in a sequence are accepted too.
    :meth:`validate` runs the one request validation (the engine client calls it).

    Raises:
        InvalidRequestError: ``prompt_token_ids`` is not a sequence of ints.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_prompt_ids)
    sampling_params: SamplingParams
    arrival_time: float
    max_tokens: int | None = None
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: Mapping[str, str] | None = None
    external_req_id: str | None = None

    def validate(
        self,
        *,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        max_logprobs: int | None = None,
    ) -> None:
        """Raise :class:`InvalidRequestError` naming the field for anything a real engine
        would choke on, or its front end refuse, or msgpack fail to encode.

        This is the client's one request validation (the engine client runs it before
        sending). It is exactly what vLLM 0.32's msgspec decoder, ``SamplingParams`` checks
        and front-end checks accept, narrowed where the engine would fail later (token ids
        outside ``[0, vocab_size)``, ``n`` other than 1); see docs/errors.md.
        """
        # Each field's common case is checked inline (this runs per request); the check_*
        # calls give the exact error.
        rid = self.request_id
        if not (type(rid) is str and rid and rid.isascii()):
            check_text(rid, "request_id", allow_empty=False)
        prompt = self.prompt_token_ids
        count = len(prompt)
        if not count:
            raise InvalidRequestError("prompt_token_ids", "must not be empty")
        if max_model_len is not None and count >= max_model_len:
            resolve_max_tokens(None, count, max_model_len)  # refuses it, in its words
        top = TOKEN_MAX if vocab_size is None else min(vocab_size - 1, TOKEN_MAX)
        for token in prompt:  # the lean loop (no enumerate) is faster than C-loop tricks
            if type(token) is not int or token < 0 or token > top:
                # The slow path: names the first bad token; numpy integers pass.
                check_token_ids(prompt, "prompt_token_ids", vocab_size)
                break
        if not isinstance(self.sampling_params, SamplingParams):
            raise InvalidRequestError("sampling_params", "must be a SamplingParams")
        self.sampling_params.validate(vocab_size=vocab_size, max_logprobs=max_logprobs)
        # min_tokens must fit the max_tokens the engine will actually see (the one rule,
        # resolve_max_tokens): a min_tokens above it fails vLLM's SamplingParams check and
        # deafens the engine.
        requested = self.max_tokens
        if requested is None:
            requested = self.sampling_params.max_tokens
        limit = resolve_max_tokens(requested, count, max_model_len)
        if self.sampling_params.min_tokens > limit:
            raise InvalidRequestError(
                "min_tokens", f"must be at most the request's max_tokens ({limit}), got "
                f"{self.sampling_params.min_tokens}"
            )
        arrival = self.arrival_time
        if not (type(arrival) is float and math.isfinite(arrival)):
            check_arrival_time(arrival)
        if self.lora_request is not None:
            _check_lora(self.lora_request)
        if self.cache_salt is not None:
            check_text(self.cache_salt, "cache_salt", allow_empty=False)
        if self.data_parallel_rank is not None:
            check_int(self.data_parallel_rank, "data_parallel_rank", low=0)
        index, wave, priority = self.client_index, self.current_wave, self.priority
        if not (type(index) is int and 0 <= index <= INT64_MAX):
            check_int(index, "client_index", low=0)
        if not (type(wave) is int and INT64_MIN <= wave <= INT64_MAX):
            check_int(wave, "current_wave")
        if not (type(priority) is int and INT64_MIN <= priority <= INT64_MAX):
            check_int(priority, "priority")
        if self.trace_headers is not None:
            check_trace_headers(self.trace_headers)
        external = self.external_req_id
        if external is not None and not (type(external) is str and external.isascii()):
            check_text(external, "external_req_id")

    def resolved_max_tokens(self, max_model_len: int | None) -> int:
        """The output-token cap the engine applies to this request with a context of
        ``max_model_len`` tokens: its ``max_tokens`` override, else its sampling parameters',
        by :func:`~.validation.resolve_max_tokens` (the one rule: above the context refused,
        beyond the prompt's room clamped to it, None the rest of the context; without a
        ``max_model_len``, the engine's default of 16).

        Raises:
            InvalidRequestError: naming ``max_tokens`` or ``prompt_token_ids``.
        """
        requested = self.max_tokens
        if requested is None:
            requested = self.sampling_params.max_tokens
        return resolve_max_tokens(requested, len(self.prompt_token_ids), max_model_len)

    def to_wire(self) -> list[Any]:
        """The 22-element positional array vLLM's decoder expects."""
        lora = self.lora_request.to_wire() if self.lora_request is not None else None
        return [
            self.request_id,
            self.prompt_token_ids,
            None,  # mm_features
            self.sampling_params.wire_for_request(self.max_tokens),
            None,  # pooling_params
            float(self.arrival_time),
            lora,
            self.cache_salt,
            self.data_parallel_rank,
            None,  # prompt_embeds
            None,  # prompt_is_token_ids
            self.client_index,
            self.current_wave,
            self.priority,
            dict(self.trace_headers) if self.trace_headers is not None else None,
            False,  # resumable
            self.external_req_id,
            None,  # reasoning_ended
            None,  # reasoning_parser_kwargs
            False,  # abort_immediately
            None,  # session_id
            None,  # kv_hints
        ]


def _check_lora(lora: object) -> None:
    if not isinstance(lora, LoRARequest):
        raise InvalidRequestError("lora_request", f"must be a LoRARequest, got "
                                  f"{type(lora).__name__}")
    check_text(lora.lora_name, "lora_request.lora_name")
    check_int(lora.lora_int_id, "lora_request.lora_int_id", low=1, high=INT64_MAX)
    check_text(lora.lora_path, "lora_request.lora_path", allow_empty=False)


def wire_default(value: object) -> int:
    """msgpack's hook for what it cannot encode: numpy integers in a prompt (validate
    accepted them); everything else a validated request holds is a plain Python value.

    Raises :class:`TypeError` for anything else.
    """
    if isinstance(value, np.integer):
        return int(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def encode_add(request: EngineCoreRequest) -> list[bytes]:
    """Frames ``[ADD, payload]`` for ``request`` (validate it first)."""
    payload = msgpack.packb(request.to_wire(), use_bin_type=True, default=wire_default)
    return [RequestType.ADD.value, payload]


def encode_abort(request_ids: Sequence[str]) -> list[bytes]:
    """Frames ``[ABORT, payload]`` aborting ``request_ids``."""
    return [RequestType.ABORT.value, pack(list(request_ids))]


def encode_utility(client_index: int, call_id: int, method: str,
                   args: Sequence[Any] = ()) -> list[bytes]:
    """Frames ``[UTILITY, payload]`` calling ``method(*args)`` on the engine."""
    return [RequestType.UTILITY.value, pack([client_index, call_id, method, list(args)])]
