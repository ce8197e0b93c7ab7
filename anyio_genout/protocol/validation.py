"""The field checks of the client's one request validation, and the limits they hold to.

A malformed request silently kills a real engine's input thread, so every check vLLM makes
(its msgspec decoder's types, ``SamplingParams._verify_args`` and the front end's ``verify``)
runs on the client before anything is sent. :meth:`.SamplingParams.validate` and
:meth:`.EngineCoreRequest.validate` are that validation: each walks its own fields with the
checks here, which raise :class:`~anyio_genout.InvalidRequestError` naming the field. Nothing
they accept fails to encode (integers fit msgpack, text is valid UTF-8, ``extra_args`` holds
only what msgpack carries).

Each decision is made here once, for the engine client, the CLI and the server alike (the
server answers with these messages, which are vLLM's): :func:`resolve_max_tokens` (the
output-token cap and the context-fit rule), :func:`check_unicode` / :func:`check_text`
(text a tokenizer takes) and :func:`check_token` / :func:`check_token_ids` (token ids in
the vocabulary).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from ..errors import InvalidRequestError

__all__ = [
    "DEFAULT_MAX_TOKENS", "INT64_MAX", "INT64_MIN", "MAX_EXTRA_ARGS_DEPTH", "TOKEN_MAX",
    "UINT64_MAX", "check_arrival_time", "check_extra_args", "check_float", "check_int",
    "check_logprobs", "check_max_tokens", "check_text", "check_token", "check_token_ids",
    "check_trace_headers", "check_unicode", "resolve_max_tokens", "short_int",
]

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
#: msgpack (and so vLLM's msgspec ``int``) holds integers in [INT64_MIN, UINT64_MAX].
UINT64_MAX: Final = 2**64 - 1
#: Token ids index int32 tensors in the engine.
TOKEN_MAX: Final = 2**31 - 1
#: How deeply ``extra_args`` may nest (msgpack itself stops at 512).
MAX_EXTRA_ARGS_DEPTH: Final = 32
#: vLLM's struct default for ``max_tokens`` (what the engine uses when the key is absent).
DEFAULT_MAX_TOKENS: Final = 16


def check_int(value: object, field: str, *, low: int = INT64_MIN,
              high: int = INT64_MAX) -> None:
    """An ``int`` (not a bool) in ``[low, high]`` (by default: a 64-bit signed integer)."""
    if type(value) is not int:
        raise InvalidRequestError(field, f"must be an integer, got {type(value).__name__}")
    if value < low:
        raise InvalidRequestError(field, f"must be at least {low}, got {short_int(value)}")
    if value > high:
        raise InvalidRequestError(field, f"must be at most {high}, got {short_int(value)}")


def check_text(value: object, field: str, *, allow_empty: bool = True) -> None:
    """A ``str`` that UTF-8 can encode (no lone surrogates), non-empty unless allowed."""
    if not isinstance(value, str):
        raise InvalidRequestError(field, f"must be a string, got {type(value).__name__}")
    if not value.isascii():
        _check_encodable(value, field)
    elif not value and not allow_empty:
        raise InvalidRequestError(field, "must not be empty")


def _check_encodable(value: str, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            field, f"is not valid Unicode text: lone surrogate at index {exc.start}") from None


def check_unicode(value: object, field: str) -> None:
    """Every string in ``value`` (walking lists and dicts; anything else passes) is text
    UTF-8 can encode: a lone surrogate is a valid JSON escape, not text a tokenizer or a
    template takes. The field named is the string's place (``messages[0].content``; a
    dict's key is named by the dict's field)."""
    if isinstance(value, str):
        if not value.isascii():
            _check_encodable(value, field)
    elif isinstance(value, list):
        # The place is named only for what may hold a string: a list of 260,000 token ids
        # (a 1 MiB body) made as many names for nothing.
        for i, item in enumerate(value):
            kind = type(item)
            if kind not in _PLAIN and (kind is not str or not item.isascii()):
                check_unicode(item, f"{field}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, field)
            kind = type(item)
            if kind not in _PLAIN and (kind is not str or not item.isascii()):
                check_unicode(item, f"{field}.{key}")


#: Decoded JSON values that hold no string.
_PLAIN: Final = frozenset({int, float, bool, type(None)})


def safe_repr(value: object) -> str:
    """``repr(value)`` for a message, with a huge integer (anywhere inside) shown by its size:
    Python refuses the decimal text of an integer past 4300 digits."""
    if type(value) is int:
        return short_int(value)
    try:
        return repr(value)
    except ValueError:
        return f"a {type(value).__name__} holding a huge integer"


def short_int(value: int) -> str:
    """``str(value)``, or its size for a huge integer."""
    # Never build the decimal text of a huge integer (Python refuses past 4300 digits).
    return str(value) if -(10**30) < value < 10**30 else f"an integer of {value.bit_length()} bits"


def check_float(value: object, field: str, low: float, high: float) -> None:
    """A number (an ``int`` or ``float``, not NaN) in ``[low, high]``."""
    # Fast path (this runs per request): NaN fails the comparison, and so does an infinity
    # unless the range itself is unbounded on that side.
    if type(value) is float and low <= value <= high:
        return
    if type(value) is int:
        try:
            number = float(value)  # what the wire will carry
        except OverflowError:
            raise InvalidRequestError(
                field, f"must be in [{low:g}, {high:g}], got {short_int(value)}") from None
    elif type(value) is float:
        number = value
    else:
        raise InvalidRequestError(field, f"must be a number, got {type(value).__name__}")
    if math.isnan(number):
        raise InvalidRequestError(field, f"must be a number, got {number}")
    if not low <= number <= high:
        if math.isinf(number):
            raise InvalidRequestError(field, f"must be a finite number, got {number}")
        raise InvalidRequestError(field, f"must be in [{low:g}, {high:g}], got {number}")


def check_logprobs(value: object, field: str, vocab_size: int | None,
                   max_logprobs: int | None) -> None:
    """A ``logprobs`` or ``prompt_logprobs`` count the engine allows."""
    # vLLM: -1 or non-negative (_verify_args); the front end then counts -1 as the whole
    # vocabulary and refuses more than max_logprobs (itself -1 for "the vocabulary").
    check_int(value, field, low=-1)
    assert isinstance(value, int)
    if not value or max_logprobs is None:
        return
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    if limit is None:
        return
    if value == -1:
        if vocab_size is None or vocab_size > limit:
            raise InvalidRequestError(
                field, f"-1 asks for the whole vocabulary ({vocab_size or 'unknown size'}), "
                f"more than the engine allows (max_logprobs={max_logprobs})")
    elif value > limit:
        raise InvalidRequestError(
            field, f"at most {limit} are allowed by the engine (max_logprobs="
            f"{max_logprobs}), got {short_int(value)}")


def check_token(value: object, field: str, vocab_size: int | None) -> None:
    """A token id: an ``int`` in ``[0, vocab_size)`` that fits int32 (vLLM's message when it
    is out of the vocabulary: ``"{id} is not in the vocabulary (0..{vocab_size - 1})"``)."""
    if type(value) is not int:
        raise InvalidRequestError(field, f"token ids must be integers, got {type(value).__name__}")
    if vocab_size is not None and not 0 <= value < vocab_size:
        raise InvalidRequestError(
            field, f"{short_int(value)} is not in the vocabulary (0..{vocab_size - 1})")
    if value < 0:
        raise InvalidRequestError(field, f"token id must be non-negative, got {short_int(value)}")
    if value > TOKEN_MAX:
        raise InvalidRequestError(field, f"token id {short_int(value)} does not fit in int32")


def check_token_ids(ids: Sequence[Any], field: str, vocab_size: int | None) -> None:
    """Name the first bad token id of ``ids`` as ``field[i]`` (:func:`check_token`; numpy
    integers pass)."""
    for i, token in enumerate(ids):
        if type(token) is not int and isinstance(token, np.integer):
            token = int(token)
        check_token(token, f"{field}[{i}]", vocab_size)


def check_max_tokens(max_tokens: int | None, max_model_len: int,
                     field: str = "max_tokens") -> None:
    """Refuse an output-token cap above the context (vLLM's serving check, in its words:
    ``"max_tokens=N cannot be greater than max_model_len=M. Please request fewer output
    tokens."``); None (fill it in) passes. This is the refusal of
    :func:`resolve_max_tokens`, for a caller that checks before the prompt is known."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise InvalidRequestError(
            field, f"{field}={short_int(max_tokens)} cannot be greater than "
            f"max_model_len={max_model_len}. Please request fewer output tokens.")


def resolve_max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int | None,
                       field: str = "max_tokens") -> int:
    """The output-token cap the engine applies to a request: the one rule for it (vLLM
    0.32's ``get_max_tokens``), used by the engine client, the CLI and the server.

    * ``max_tokens`` above ``max_model_len`` is refused (:func:`check_max_tokens`), and so
      is a prompt of ``max_model_len`` tokens or more (no room to generate);
    * otherwise the cap is ``max_tokens`` (None: the whole rest of the context), at most
      the room the prompt leaves, ``max_model_len - prompt_len``: a prompt plus
      ``max_tokens`` beyond the context ends at the context (finish ``length``).
    * Without a ``max_model_len`` (nothing to fill in from): ``max_tokens``, else the
      engine's default of :data:`DEFAULT_MAX_TOKENS`.

    Raises:
        InvalidRequestError: naming ``field`` (``max_tokens`` not an integer of at least 1,
            or above the context) or ``prompt_token_ids`` (the prompt fills the context).
    """
    if max_model_len is not None and prompt_len < max_model_len and (
            max_tokens is None or (type(max_tokens) is int and 1 <= max_tokens <= max_model_len)):
        room = max_model_len - prompt_len  # the common case (this runs per request)
        return room if max_tokens is None or max_tokens > room else max_tokens
    if max_tokens is not None:
        check_int(max_tokens, field, low=1)
    if max_model_len is None:
        return DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            "prompt_token_ids", f"prompt of {prompt_len} tokens leaves no room to generate "
            f"(max_model_len={max_model_len})")
    check_max_tokens(max_tokens, max_model_len, field)
    room = max_model_len - prompt_len
    return room if max_tokens is None or max_tokens > room else max_tokens


def check_extra_args(value: object) -> None:
    """``extra_args``: string keys, then only what msgpack encodes (at most 32 deep)."""
    # vLLM decodes extra_args as dict[str, Any]: string keys at the top, then anything
    # msgpack carries (a tuple key arrives as a tuple). Only what msgpack can encode passes.
    if not isinstance(value, Mapping):
        raise InvalidRequestError("extra_args", f"must be a mapping with string keys, got "
                                  f"{type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str):
            raise InvalidRequestError("extra_args", f"keys must be strings, got "
                                      f"{type(key).__name__} {safe_repr(key)}")
        check_text(key, f"extra_args[{safe_repr(key)}]")
        _check_plain(item, f"extra_args[{safe_repr(key)}]", 1)


def _check_plain(value: object, field: str, depth: int) -> None:
    if depth > MAX_EXTRA_ARGS_DEPTH:
        raise InvalidRequestError(field, f"nested more than {MAX_EXTRA_ARGS_DEPTH} deep")
    if value is None or isinstance(value, bool | float | bytes | bytearray):
        return
    if isinstance(value, str):
        check_text(value, field)
        return
    if isinstance(value, int):
        if not INT64_MIN <= value <= UINT64_MAX:
            raise InvalidRequestError(field, f"integers must fit in 64 bits, got "
                                      f"{short_int(value)}")
        return
    if isinstance(value, dict):  # msgpack encodes dicts, not other mappings
        for k, v in value.items():
            _check_plain(k, f"{field} key {safe_repr(k)}", depth + 1)
            _check_plain(v, f"{field}[{safe_repr(k)}]", depth + 1)
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_plain(v, f"{field}[{i}]", depth + 1)
        return
    raise InvalidRequestError(field, f"cannot be sent to the engine: {type(value).__name__}")


def check_arrival_time(value: object) -> None:
    """A finite number of seconds since the epoch."""
    if type(value) is not float and type(value) is not int:
        raise InvalidRequestError("arrival_time", f"must be a number (seconds since the "
                                  f"epoch), got {type(value).__name__}")
    try:
        finite = math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        raise InvalidRequestError("arrival_time", "must be a finite number of seconds since "
                                  "the epoch")


def check_trace_headers(headers: object) -> None:
    """A mapping of UTF-8 strings to UTF-8 strings."""
    if not isinstance(headers, Mapping):
        raise InvalidRequestError("trace_headers", f"must map strings to strings, got "
                                  f"{type(headers).__name__}")
    for key, value in headers.items():
        if not isinstance(key, str):
            raise InvalidRequestError("trace_headers", f"keys must be strings, got "
                                      f"{type(key).__name__}")
        check_text(key, f"trace_headers[{safe_repr(key)}]")
        check_text(value, f"trace_headers[{safe_repr(key)}]")
