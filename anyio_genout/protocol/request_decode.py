"""Engine side of the input socket: decoding requests as strictly as vLLM does.

The mock engine decodes every input message with :func:`decode_request`. It refuses exactly
what kills a real engine's input thread: the types vLLM 0.32's msgspec decoder enforces on
``EngineCoreRequest``, its ``SamplingParams`` (with ``StructuredOutputsParams``) and
``LoRARequest``, and the checks their ``__post_init__`` runs. It is not the client's
validation (:mod:`.validation`), which is stricter (the front end's checks, and what would
fail the engine later).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import msgpack

from ..errors import InvalidRequestError, ProtocolError
from .arrays import describe
from .packing import unpack
from .requests import REQUEST_FIELDS, EngineCoreRequest, LoRARequest, RequestType
from .sampling import DEFAULT_MAX_TOKENS, SamplingParams

__all__ = ["AbortRequest", "AddRequest", "UtilityRequest", "decode_request"]

_REQUIRED_FIELDS: Final = 9

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
    payload = _unpack_request(frames[1], f"{kind.name} request")
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
    "structured_outputs": (
        lambda v: v is None or (type(v) is dict and all(type(k) is str for k in v)),
        "a map with str keys or nil",
    ),
}

# vLLM 0.32's StructuredOutputsParams, a dataclass msgspec decodes from a map (missing keys
# take their defaults, unknown ones are ignored) before its __post_init__ runs.
_STRUCTURED_TYPES: Final[dict[str, tuple[Callable[[object], bool], str]]] = {
    "json": (lambda v: v is None or type(v) is str or type(v) is dict, "str, map or nil"),
    "regex": (_optional(_is_str), "str or nil"),
    "choice": (_optional(_is_str_list), "[str] or nil"),
    "grammar": (_optional(_is_str), "str or nil"),
    "json_object": (_optional(_is_bool), "bool or nil"),
    "disable_any_whitespace": (_is_bool, "bool"),
    "disable_additional_properties": (_is_bool, "bool"),
    "whitespace_pattern": (_optional(_is_str), "str or nil"),
    "structural_tag": (_optional(_is_str), "str or nil"),
    "_backend": (_optional(_is_str), "str or nil"),
    "_backend_was_auto": (_is_bool, "bool"),
}
_CONSTRAINTS: Final = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

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
        # vLLM: "sampling_params and pooling_params can't both be unset" (pooling is never
        # set for a generation engine), raised in the input thread.
        raise ProtocolError(f"{where}.sampling_params: expected a map, got nil")
    if type(sampling) is not dict or not all(type(k) is str for k in sampling):
        raise ProtocolError(f"{where}.sampling_params: expected a map with str keys, got "
                            f"{describe(sampling)}")
    for key, value in sampling.items():
        rule = _SAMPLING_TYPES.get(key)
        if rule is not None and not rule[0](value):
            raise ProtocolError(f"{where}.sampling_params.{key}: expected {rule[1]}, got "
                                f"{describe(value)}")
    structured = sampling.get("structured_outputs")
    if structured is not None:
        _verify_structured(structured, f"{where}.sampling_params.structured_outputs")
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
    lora_request = None if lora is None else _decode_lora(lora, f"{where}.lora_request")
    _verify_sampling(sampling, f"{where}.sampling_params")
    try:
        params = SamplingParams.from_wire(sampling)
    except (InvalidRequestError, TypeError, ValueError) as exc:  # pragma: no cover - checked
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


def _verify_structured(wire: Mapping[str, Any], where: str) -> None:
    """msgspec's types for vLLM's StructuredOutputsParams, then its ``__post_init__``: exactly
    one constraint. The rest (an empty choice list, a schema that is no JSON Schema, no
    ``_backend``) the engine decodes, then fails only that request."""
    for key, value in wire.items():
        rule = _STRUCTURED_TYPES.get(key)
        if rule is not None and not rule[0](value):
            raise ProtocolError(f"{where}.{key}: expected {rule[1]}, got {describe(value)}")
    kinds = [kind for kind in _CONSTRAINTS if wire.get(kind) is not None]
    if len(kinds) != 1:
        raise ProtocolError(f"{where}: exactly one kind of structured outputs constraint must "
                            f"be set, got {len(kinds)}: {', '.join(kinds) or 'none'}")


def _unpack_request(data: bytes, what: str) -> Any:
    try:
        return unpack(data, what)
    except ProtocolError:
        # msgpack-python cannot build a dict whose key is an array (a list is unhashable);
        # msgspec, vLLM's decoder, makes such a key a tuple (``extra_args`` may nest them).
        # Decode again that way; a message that still fails is refused as before.
        try:
            return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True,
                                   ext_hook=_no_ext, object_pairs_hook=_hashable_pairs)
        except Exception:
            pass
        raise


def _no_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} in a request")


def _hashable_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    return {_hashable(k): v for k, v in pairs}


def _hashable(key: Any) -> Any:
    if type(key) is list:
        return tuple(_hashable(k) for k in key)
    return key


def _decode_lora(lora: object, where: str) -> LoRARequest:
    # vLLM's LoRARequest: array_like [lora_name: str, lora_int_id: int, lora_path: str = "",
    # base_model_name: str | None, load_inplace: bool, is_3d_lora_weight: bool]; extra
    # trailing fields are ignored; __post_init__ refuses an id below 1 and asserts a path.
    if type(lora) is not list or len(lora) < 2:
        raise ProtocolError(f"{where}: expected an array of at least 2 fields, got "
                            f"{describe(lora)}")
    checks: tuple[tuple[str, Callable[[object], bool], str], ...] = (
        ("lora_name", _is_str, "str"),
        ("lora_int_id", _is_int, "int"),
        ("lora_path", _is_str, "str"),
        ("base_model_name", _optional(_is_str), "str or nil"),
        ("load_inplace", _is_bool, "bool"),
        ("is_3d_lora_weight", _is_bool, "bool"),
    )
    for (name, check, expected), value in zip(checks, lora, strict=False):
        if not check(value):
            raise ProtocolError(f"{where}.{name}: expected {expected}, got {describe(value)}")
    path = lora[2] if len(lora) > 2 else ""
    if lora[1] < 1:
        raise ProtocolError(f"{where}.lora_int_id: id must be > 0, got {lora[1]}")
    if not path:
        raise ProtocolError(f"{where}.lora_path: AssertionError: lora_path cannot be empty")
    return LoRARequest(lora[0], lora[1], path)


#: ``VLLM_MAX_N_SEQUENCES``' default.
_MAX_N_SEQUENCES: Final = 16384
_SAMPLING_EPS: Final = 1e-5


def _verify_sampling(w: Mapping[str, Any], where: str) -> None:
    """vLLM 0.32's ``SamplingParams.__post_init__`` checks (``_verify_args``), which its
    msgspec decoder runs on every ADD (a failure kills the input thread); types were
    checked already (``_SAMPLING_TYPES``).

    Only these: the front end's checks (vocabulary, ``max_logprobs``, prompt length) are
    not the engine's, and an engine that accepts a request may still die on it later (a
    token id out of vocabulary), as the mock engine's scheduler does.
    """
    def fail(key: str, message: str) -> ProtocolError:
        return ProtocolError(f"{where}.{key}: {message}")

    n = w.get("n", 1)
    if not 1 <= n <= _MAX_N_SEQUENCES:
        raise fail("n", f"must be in [1, {_MAX_N_SEQUENCES}], got {n}")
    for key in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= w.get(key, 0.0) <= 2.0:
            raise fail(key, f"must be in [-2, 2], got {w[key]}")
    penalty = w.get("repetition_penalty", 1.0)
    if not (math.isfinite(penalty) and penalty > 0.0):
        raise fail("repetition_penalty", f"must be finite and > 0, got {penalty}")
    temperature = w.get("temperature", 1.0)
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 2.0):
        raise fail("temperature", f"must be in [0, 2], got {temperature}")
    if not 0.0 < w.get("top_p", 1.0) <= 1.0:
        raise fail("top_p", f"must be in (0, 1], got {w['top_p']}")
    if w.get("top_k", 0) < -1:
        raise fail("top_k", f"must be 0 (disable), or at least 1, got {w['top_k']}")
    if not 0.0 <= w.get("min_p", 0.0) <= 1.0:
        raise fail("min_p", f"must be in [0, 1], got {w['min_p']}")
    # max_tokens nil decodes; the engine's preprocessing then fails (Request asserts it
    # is set), which vLLM turns into a request-scoped error output, not a dead thread.
    max_tokens = w.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is not None and max_tokens < 1:
        raise fail("max_tokens", f"must be at least 1, got {max_tokens}")
    min_tokens = w.get("min_tokens", 0)
    if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise fail("min_tokens", f"must be in [0, max_tokens={max_tokens}], got {min_tokens}")
    for key in ("logprobs", "prompt_logprobs"):
        value = w.get(key)
        if value is not None and value < -1:
            raise fail(key, f"must be non-negative or -1, got {value}")
    stop = w.get("stop")
    stops = [stop] if type(stop) is str else (stop or [])
    if any(not text for text in stops):
        raise fail("stop", "cannot contain an empty string")
    if stops and not w.get("detokenize", True):
        raise fail("stop", "stop strings are only supported when detokenize is True")
    if any(not word for word in w.get("bad_words") or []):
        raise fail("bad_words", "cannot contain an empty string")
    if temperature < _SAMPLING_EPS and n > 1:
        raise fail("n", f"must be 1 when using greedy sampling, got {n}")
