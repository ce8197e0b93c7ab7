"""``TextRequest``: a request in text (a prompt, chat messages or token ids), and its checks.

Construction only converts (``stop`` given as one string becomes a one-string tuple); every
check runs when ``async with text_client.generate(request)`` is entered, before anything is
sent, and names the field (:func:`check_text_request`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import attrs

from ..errors import InvalidRequestError
from ..protocol import LoRARequest, SamplingParams
from ..protocol.sampling import token_ids
from ..protocol.validation import check_text

__all__ = ["TextRequest", "check_text_request", "text_request_id"]


def text_request_id() -> str:
    """A fresh request id: ``"text-"`` and 16 random hex characters."""
    return f"text-{os.urandom(8).hex()}"


def _stop(value: str | Iterable[str]) -> tuple[str, ...]:
    # One string is one stop string (as vLLM takes it); anything else that is not a list or
    # tuple is kept as it is, for the check on entering to name ``stop``.
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(value)
    return cast("tuple[str, ...]", value)


#: Keys of ``chat_template_kwargs`` that the request sets itself.
_RESERVED_TEMPLATE_KEYS = frozenset({"messages", "add_generation_prompt"})


@attrs.frozen(kw_only=True)
class TextRequest:
    """One generation request in text: exactly one of ``prompt`` (a string, encoded with the
    tokenizer), ``messages`` (chat messages, rendered by the model's chat template, then
    encoded) or ``prompt_token_ids`` (sent as they are).

    ``sampling_params`` holds the token-level options (``max_tokens``, ``min_tokens``,
    ``temperature``, ``stop_token_ids``, ...); the text options are vLLM's:

    * ``stop``: stop strings (a ``str`` is one stop string). The generation ends at the
      first one to complete in the text; the text is cut before it (after it with
      ``include_stop_str_in_output``) and the token ids after the token that completed it
      are dropped. While streaming, the last ``len(longest stop) - 1`` characters are held
      back until they cannot start a stop string. ``min_tokens`` tokens come before any
      stop string counts.
    * ``skip_special_tokens`` (special tokens left out of the text),
      ``spaces_between_special_tokens`` (with ``skip_special_tokens=False``: a space between
      consecutive added tokens), ``detokenize`` (False: no text at all, and no stop strings).
    * ``add_special_tokens``: encode the prompt with the tokenizer's special tokens (BOS);
      None means True for ``prompt`` and False for ``messages`` (the chat template adds its
      own), as vLLM does. ``add_generation_prompt`` and ``chat_template_kwargs`` go to the
      chat template; the key ``continue_final_message`` (True) is transformers': the
      rendered prompt is cut after the last message's content, for the model to go on
      with it.

    * ``bad_words``: words never generated, as vLLM bans them (each word's token sequence,
      and the one with a leading space where that differs: :mod:`.bad_words`).
    * ``truncate_prompt_tokens``: keep only that many prompt tokens (-1: the context less
      one), cut on ``truncation_side``: "left" keeps the last ones, "right" the first
      ones; None (vLLM's default for a generating model) keeps the tokenizer's special
      tokens (BOS) and the last of the text's. A text that must be cut is not refused for
      its length.

    ``request_id`` (default: ``"text-"`` and random hex), ``arrival_time``, ``cache_salt``,
    ``trace_headers``, ``priority``, ``data_parallel_rank`` and ``lora_request`` pass to the
    :class:`~anyio_genout.GenerateRequest` underneath.
    """

    request_id: str = attrs.field(factory=text_request_id)
    prompt: str | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    prompt_token_ids: Sequence[int] | None = None
    sampling_params: SamplingParams = attrs.field(factory=SamplingParams)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Mapping[str, Any] | None = None
    arrival_time: float | None = None
    cache_salt: str | None = None
    trace_headers: Mapping[str, str] | None = None
    priority: int = 0
    data_parallel_rank: int | None = None
    lora_request: LoRARequest | None = None
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_stop)
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None


def _check_bool(value: object, field: str) -> None:
    if type(value) is not bool:
        raise InvalidRequestError(field, f"must be a bool, got {type(value).__name__}")


def check_text_request(request: TextRequest) -> None:
    """Check the text-level fields of ``request`` (the token-level ones are checked by the
    generate layer when the request is sent).

    Raises:
        InvalidRequestError: naming the field: not exactly one of ``prompt``, ``messages``
            and ``prompt_token_ids``; a ``prompt`` that is not a string;
            ``prompt_token_ids`` that are not a sequence; ``messages`` that
            are not a non-empty list of mappings; ``stop`` that is not strings, or has an
            empty one; ``stop`` with ``detokenize=False`` (vLLM refuses it too); a flag that
            is not a bool; ``chat_template_kwargs`` that is not a mapping of strings or sets
            what the request sets itself.
    """
    if not isinstance(request, TextRequest):
        raise InvalidRequestError("request", f"must be a TextRequest, got "
                                  f"{type(request).__name__}")
    given = [name for name in ("prompt", "messages", "prompt_token_ids")
             if getattr(request, name) is not None]
    if len(given) != 1:
        field = given[1] if len(given) > 1 else "prompt"
        found = " and ".join(given) if given else "none"
        raise InvalidRequestError(field, "give exactly one of prompt, messages and "
                                  f"prompt_token_ids (got {found})")
    if request.prompt is not None:
        # Text the tokenizer cannot take (a lone surrogate) is refused here, by its field.
        check_text(request.prompt, "prompt")
    if request.prompt_token_ids is not None:
        # A non-sequence (an int, a string) is refused here; the ids themselves are checked
        # by the generate layer's one validation when the request is sent.
        token_ids(request.prompt_token_ids, "prompt_token_ids")
    messages = request.messages
    if messages is not None:
        if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
            raise InvalidRequestError("messages", "must be a list of messages (mappings with "
                                      "'role' and 'content')")
        if not messages:
            raise InvalidRequestError("messages", "must not be empty")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise InvalidRequestError(f"messages[{i}]", "must be a mapping with 'role' "
                                          f"and 'content', got {type(message).__name__}")
            _check_message_text(message, f"messages[{i}]")
    stop = _strings(request.stop, "stop")
    for i, text in enumerate(stop):
        if not text:
            raise InvalidRequestError(f"stop[{i}]", "must not be an empty string")
        check_text(text, f"stop[{i}]")
    for field in ("include_stop_str_in_output", "skip_special_tokens",
                  "spaces_between_special_tokens", "detokenize", "add_generation_prompt"):
        _check_bool(getattr(request, field), field)
    if request.add_special_tokens is not None:
        _check_bool(request.add_special_tokens, "add_special_tokens")
    if stop and not request.detokenize:
        raise InvalidRequestError("stop", "stop strings need detokenize=True (the text is "
                                  "where they are matched)")
    for i, word in enumerate(_strings(request.bad_words, "bad_words")):
        check_text(word, f"bad_words[{i}]")
    keep = request.truncate_prompt_tokens
    if keep is not None and (type(keep) is not int or keep < -1):
        raise InvalidRequestError("truncate_prompt_tokens", f"must be an integer >= -1, got "
                                  f"{keep!r}")
    if request.truncation_side not in (None, "left", "right"):
        raise InvalidRequestError("truncation_side", "`truncation_side` must be either "
                                  "'left' or 'right'.")
    kwargs = request.chat_template_kwargs
    if kwargs is not None:
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise InvalidRequestError("chat_template_kwargs",
                                      "must be a mapping with string keys")
        reserved = sorted(_RESERVED_TEMPLATE_KEYS & set(kwargs))
        if reserved:
            raise InvalidRequestError("chat_template_kwargs", f"must not set "
                                      f"{', '.join(reserved)} (fields of the request)")


def _strings(value: object, field: str) -> tuple[str, ...]:
    """``value`` if it is a tuple of strings (what the converter makes of a list), else an
    InvalidRequestError naming ``field`` or its bad item."""
    if not isinstance(value, tuple):
        raise InvalidRequestError(field, f"must be a string or a list of strings, got "
                                  f"{type(value).__name__}")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise InvalidRequestError(f"{field}[{i}]", f"must be a string, got "
                                      f"{type(text).__name__}")
    return value


def _check_message_text(message: Mapping[Any, Any], field: str) -> None:
    """Every string of a message the template may render (its values, and the ``text`` of
    content parts) must be valid Unicode: the tokenizer cannot take a lone surrogate."""
    for key, value in message.items():
        if isinstance(value, str):
            check_text(value, f"{field}.{key}")
        elif key == "content" and isinstance(value, Sequence):
            for j, part in enumerate(value):
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    check_text(part["text"], f"{field}.content[{j}].text")
