"""Front end -> engine: ADD, ABORT and UTILITY requests on the engine's input socket.

A request message is ``[type byte, msgpack payload, *aux frames]`` (the input ROUTER prepends
the engine identity). ADD carries ``EngineCoreRequest``, a positional array of 22 fields in
vLLM's order; ABORT a list of request ids; UTILITY ``[client_index, call_id, method, args]``.
Both directions are here: the client encodes, the mock engine decodes (as strictly as vLLM).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs

from ..errors import InvalidRequestError, ProtocolError
from .arrays import describe
from .packing import pack, unpack
from .sampling import DEFAULT_MAX_TOKENS, SamplingParams, int_tuple

__all__ = [
    "REQUEST_FIELDS",
    "AbortRequest",
    "AddRequest",
    "EngineCoreRequest",
    "LoRARequest",
    "RequestType",
    "UtilityRequest",
    "decode_request",
    "encode_abort",
    "encode_add",
    "encode_utility",
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
_REQUIRED_FIELDS: Final = 9


@attrs.frozen
class LoRARequest:
    """A LoRA adapter to apply (vLLM's ``LoRARequest``, positional on the wire)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def to_wire(self) -> list[Any]:
        return [self.lora_name, self.lora_int_id, self.lora_path]


@attrs.frozen(kw_only=True)
class EngineCoreRequest:
    """One generation request as the engine sees it (token ids in, n=1)."""

    request_id: str
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=int_tuple)
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
        """Raise :class:`InvalidRequestError` for anything a real engine would choke on."""
        if type(self.request_id) is not str or not self.request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", "must not be empty")
        for i, token in enumerate(self.prompt_token_ids):
            if type(token) is not int or token < 0 or token > 2**31 - 1:
                raise InvalidRequestError(
                    f"prompt_token_ids[{i}]", f"must be a non-negative int32, got {token!r}"
                )
            if vocab_size is not None and token >= vocab_size:
                raise InvalidRequestError(
                    f"prompt_token_ids[{i}]",
                    f"token id {token} is out of vocabulary (vocab_size={vocab_size})",
                )
        if max_model_len is not None and len(self.prompt_token_ids) >= max_model_len:
            raise InvalidRequestError(
                "prompt_token_ids",
                f"prompt of {len(self.prompt_token_ids)} tokens leaves no room to generate "
                f"(max_model_len={max_model_len})",
            )
        if not isinstance(self.sampling_params, SamplingParams):
            raise InvalidRequestError("sampling_params", "must be a SamplingParams")
        self.sampling_params.validate(vocab_size=vocab_size, max_logprobs=max_logprobs)
        if self.max_tokens is not None and (type(self.max_tokens) is not int
                                            or self.max_tokens < 1):
            raise InvalidRequestError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        # min_tokens must fit the max_tokens the engine will actually see: this request's
        # override, else the sampling parameters', else what the client fills in from
        # max_model_len, else (nothing to fill it in from) the engine's default of 16.
        # A min_tokens above it fails vLLM's SamplingParams check and deafens the engine.
        limit = self.max_tokens if self.max_tokens is not None else \
            self.sampling_params.max_tokens
        if limit is None:
            limit = (DEFAULT_MAX_TOKENS if max_model_len is None
                     else max_model_len - len(self.prompt_token_ids))
        if self.sampling_params.min_tokens > limit:
            raise InvalidRequestError(
                "min_tokens", f"must be at most the request's max_tokens ({limit}), got "
                f"{self.sampling_params.min_tokens}"
            )
        if type(self.arrival_time) not in (int, float):
            raise InvalidRequestError("arrival_time", "must be a number (seconds since epoch)")
        if self.cache_salt is not None and (type(self.cache_salt) is not str
                                            or not self.cache_salt):
            raise InvalidRequestError("cache_salt", "must be a non-empty string or None")
        if self.data_parallel_rank is not None and (
            type(self.data_parallel_rank) is not int or self.data_parallel_rank < 0
        ):
            raise InvalidRequestError("data_parallel_rank", "must be a non-negative int")
        if type(self.priority) is not int or not -(2**63) <= self.priority < 2**63:
            raise InvalidRequestError("priority", "must be a 64-bit integer")
        if self.trace_headers is not None and not (
            isinstance(self.trace_headers, Mapping)
            and all(type(k) is str and type(v) is str for k, v in self.trace_headers.items())
        ):
            raise InvalidRequestError("trace_headers", "must map strings to strings")
        if self.lora_request is not None and not isinstance(self.lora_request, LoRARequest):
            raise InvalidRequestError("lora_request", "must be a LoRARequest")

    def to_wire(self) -> list[Any]:
        """The 22-element positional array vLLM's decoder expects."""
        lora = self.lora_request.to_wire() if self.lora_request is not None else None
        return [
            self.request_id,
            list(self.prompt_token_ids),
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


def encode_add(request: EngineCoreRequest) -> list[bytes]:
    """Frames ``[ADD, payload]`` for ``request`` (validate it first)."""
    return [RequestType.ADD.value, pack(request.to_wire())]


def encode_abort(request_ids: Sequence[str]) -> list[bytes]:
    """Frames ``[ABORT, payload]`` aborting ``request_ids``."""
    return [RequestType.ABORT.value, pack(list(request_ids))]


def encode_utility(client_index: int, call_id: int, method: str,
                   args: Sequence[Any] = ()) -> list[bytes]:
    """Frames ``[UTILITY, payload]`` calling ``method(*args)`` on the engine."""
    return [RequestType.UTILITY.value, pack([client_index, call_id, method, list(args)])]


# ---------------------------------------------------------------- engine side


@attrs.frozen
class AddRequest:
    """A decoded ADD: the request and its raw wire map of sampling parameters."""

    request: EngineCoreRequest
    sampling_wire: Mapping[str, Any]


@attrs.frozen
class AbortRequest:
    request_ids: tuple[str, ...]


@attrs.frozen
class UtilityRequest:
    client_index: int
    call_id: int
    method: str
    args: tuple[Any, ...]


def decode_request(frames: Sequence[bytes]) -> AddRequest | AbortRequest | UtilityRequest:
    """Decode an input-socket message as the engine does, raising :class:`ProtocolError`.

    This is as strict as vLLM 0.32's msgspec decoder plus ``SamplingParams.__post_init__``:
    a message this rejects is one that would silently kill a real engine's input thread.
    """
    if len(frames) < 2:
        raise ProtocolError(f"request: expected [type, payload], got {len(frames)} frame(s)")
    try:
        kind = RequestType(bytes(frames[0]))
    except ValueError:
        raise ProtocolError(f"request: unknown request type {bytes(frames[0])!r}") from None
    payload = unpack(frames[1], f"{kind.name} request")
    if kind is RequestType.ABORT:
        if type(payload) is not list or not all(type(r) is str for r in payload):
            raise ProtocolError("ABORT request: expected a list of request id strings")
        return AbortRequest(tuple(payload))
    if kind is RequestType.UTILITY:
        if (type(payload) is not list or len(payload) != 4 or type(payload[0]) is not int
                or type(payload[1]) is not int or type(payload[2]) is not str
                or type(payload[3]) is not list):
            raise ProtocolError(
                "UTILITY request: expected [client_index, call_id, method, args]"
            )
        return UtilityRequest(payload[0], payload[1], payload[2], tuple(payload[3]))
    if kind is RequestType.ADD:
        return _decode_add(payload)
    raise ProtocolError(f"request: {kind.name} is only sent by a data-parallel coordinator")


def _is_int(v: object) -> bool:
    return type(v) is int


def _is_number(v: object) -> bool:
    return type(v) is float or type(v) is int


def _is_bool(v: object) -> bool:
    return type(v) is bool


def _is_str(v: object) -> bool:
    return type(v) is str


def _is_int_list(v: object) -> bool:
    return type(v) is list and all(type(t) is int for t in v)


def _is_str_list(v: object) -> bool:
    return type(v) is list and all(type(t) is str for t in v)


def _optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or check(v)


# The types vLLM 0.32's msgspec decoder enforces on SamplingParams keys (field-dump): a
# mismatch is a ValidationError that kills a real engine's input thread. As in msgspec, an
# int is accepted for a float but a bool is not accepted for an int. Unknown keys are ignored.
_SAMPLING_TYPES: Final[dict[str, tuple[Callable[[object], bool], str]]] = {
    "n": (_is_int, "int"),
    "presence_penalty": (_is_number, "float"),
    "frequency_penalty": (_is_number, "float"),
    "repetition_penalty": (_is_number, "float"),
    "temperature": (_is_number, "float"),
    "top_p": (_is_number, "float"),
    "top_k": (_is_int, "int"),
    "min_p": (_is_number, "float"),
    "seed": (_optional(_is_int), "int or nil"),
    "stop": (lambda v: v is None or type(v) is str or _is_str_list(v), "str, [str] or nil"),
    "stop_token_ids": (_optional(_is_int_list), "[int] or nil"),
    "ignore_eos": (_is_bool, "bool"),
    "max_tokens": (_optional(_is_int), "int or nil"),
    "min_tokens": (_is_int, "int"),
    "logprobs": (_optional(_is_int), "int or nil"),
    "prompt_logprobs": (_optional(_is_int), "int or nil"),
    "detokenize": (_is_bool, "bool"),
    "skip_special_tokens": (_is_bool, "bool"),
    "spaces_between_special_tokens": (_is_bool, "bool"),
    "include_stop_str_in_output": (_is_bool, "bool"),
    "output_kind": (lambda v: type(v) is int and v in (0, 1, 2), "0, 1 or 2"),
    "_eos_token_id": (_optional(_is_int), "int or nil"),
    "_all_stop_token_ids": (_is_int_list, "[int]"),
    "logit_bias": (
        lambda v: v is None or (type(v) is dict and all(
            type(k) is int and _is_number(b) for k, b in v.items())),
        "{int: float} or nil",
    ),
    "allowed_token_ids": (_optional(_is_int_list), "[int] or nil"),
    "extra_args": (
        lambda v: v is None or (type(v) is dict and all(type(k) is str for k in v)),
        "{str: any} or nil",
    ),
    "bad_words": (_optional(_is_str_list), "[str] or nil"),
    "_bad_words_token_ids": (
        lambda v: v is None or (type(v) is list and all(_is_int_list(w) for w in v)),
        "[[int]] or nil",
    ),
    "skip_reading_prefix_cache": (_optional(_is_bool), "bool or nil"),
}

#: Fields 9..21 of EngineCoreRequest (all have defaults): index -> (check, description).
_OPTIONAL_FIELDS: Final[dict[int, tuple[Callable[[object], bool], str]]] = {
    10: (lambda v: v is None or (type(v) is list and all(type(b) is bool for b in v)),
         "[bool] or nil"),
    11: (_is_int, "int"),
    12: (_is_int, "int"),
    13: (_is_int, "int"),
    14: (lambda v: v is None or (type(v) is dict and all(
        type(k) is str and type(x) is str for k, x in v.items())), "{str: str} or nil"),
    15: (_is_bool, "bool"),
    16: (_optional(_is_str), "str or nil"),
    17: (_optional(_is_bool), "bool or nil"),
    18: (lambda v: v is None or (type(v) is dict and all(type(k) is str for k in v)),
         "{str: any} or nil"),
    19: (_is_bool, "bool"),
    20: (_optional(_is_str), "str or nil"),
}
_DEFAULTS: Final[dict[int, Any]] = {11: 0, 12: 0, 13: 0, 15: False, 19: False}


def _decode_add(payload: object) -> AddRequest:
    where = "EngineCoreRequest"
    if type(payload) is not list or len(payload) < _REQUIRED_FIELDS:
        raise ProtocolError(f"{where}: expected an array of at least {_REQUIRED_FIELDS} "
                            f"fields, got {describe(payload)}")
    # Missing trailing fields take their defaults; extra ones are ignored (as in msgspec).
    fields = payload[:len(REQUEST_FIELDS)]
    fields += [_DEFAULTS.get(i) for i in range(len(fields), len(REQUEST_FIELDS))]
    rid, prompt, _mm, sampling, _pooling, arrival, lora, salt, dp_rank = fields[:9]
    if type(rid) is not str:
        raise ProtocolError(f"{where}.request_id: expected str, got {describe(rid)}")
    if type(prompt) is not list or not all(type(t) is int for t in prompt):
        raise ProtocolError(f"{where}.prompt_token_ids: expected a list of int, got "
                            f"{describe(prompt)}")
    if sampling is None:
        sampling = {}
    if type(sampling) is not dict or not all(type(k) is str for k in sampling):
        raise ProtocolError(f"{where}.sampling_params: expected a map with str keys, got "
                            f"{describe(sampling)}")
    for key, value in sampling.items():
        rule = _SAMPLING_TYPES.get(key)
        if rule is not None and not rule[0](value):
            raise ProtocolError(f"{where}.sampling_params.{key}: expected {rule[1]}, got "
                                f"{describe(value)}")
    if type(arrival) is not float and type(arrival) is not int:
        raise ProtocolError(f"{where}.arrival_time: expected a number, got {describe(arrival)}")
    if dp_rank is not None and type(dp_rank) is not int:
        raise ProtocolError(f"{where}.data_parallel_rank: expected int or nil, got "
                            f"{describe(dp_rank)}")
    if salt is not None and type(salt) is not str:
        raise ProtocolError(f"{where}.cache_salt: expected str or nil, got {describe(salt)}")
    for index, (check, description) in _OPTIONAL_FIELDS.items():
        if not check(fields[index]):
            raise ProtocolError(f"{where}.{REQUEST_FIELDS[index]}: expected {description}, got "
                                f"{describe(fields[index])}")
    lora_request = None
    if lora is not None:
        if (type(lora) is not list or len(lora) < 2 or type(lora[0]) is not str
                or type(lora[1]) is not int or (len(lora) > 2 and type(lora[2]) is not str)):
            raise ProtocolError(f"{where}.lora_request: expected [name, id, path, ...], got "
                                f"{describe(lora)}")
        lora_request = LoRARequest(lora[0], lora[1], lora[2] if len(lora) > 2 else "")
    try:
        params = SamplingParams.from_wire(sampling)
        params.validate()
    except (InvalidRequestError, TypeError, ValueError) as exc:
        raise ProtocolError(f"{where}.sampling_params: {exc}") from None
    request = EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=params,
        arrival_time=float(arrival),
        max_tokens=params.max_tokens,
        lora_request=lora_request,
        cache_salt=salt,
        data_parallel_rank=dp_rank,
        client_index=fields[11],
        current_wave=fields[12],
        priority=fields[13],
        trace_headers=fields[14],
        external_req_id=fields[16],
    )
    return AddRequest(request, sampling)
