"""Chat templates and tokenization off the event loop, and the context's character bound.

Rendering a chat template and encoding a long text are CPU work of unbounded length (a
template is a program; 1 MiB of text takes 1-2 s to encode): on the event loop they would
stall every other request, ``/health`` included. :class:`Offload` runs them in worker
threads, a few at a time (one :class:`anyio.CapacityLimiter` each), so a slow one delays only
its own request. A text of at most :data:`ENCODE_INLINE_CHARS` characters is encoded inline:
the thread hop (55-110 µs) costs more than encoding it.

Before any of that, :func:`check_prompt_chars` refuses a text that cannot fit the context
whatever it encodes to (longer than ``(max_model_len - 1) * max_chars_per_token``
characters), as vLLM does, at the cost of a ``len()``; a template's output is held to the
same bound while it renders.
"""

from __future__ import annotations

import functools
from typing import Any, Final, final

import anyio
import anyio.to_thread

from ..errors import InvalidRequestError
from .request import TextRequest
from .template_sandbox import RenderLimitError
from .tokenizer import Tokenizer

__all__ = ["ENCODE_INLINE_CHARS", "ENCODE_THREADS", "RENDER_THREADS", "Offload",
           "check_prompt_chars", "max_prompt_chars"]

#: Texts up to this many characters are encoded on the event loop (about 130 µs at most).
ENCODE_INLINE_CHARS: Final = 256
#: Worker threads encoding at once (the encoding releases the GIL: they run in parallel).
ENCODE_THREADS: Final = 4
#: Worker threads rendering chat templates at once. Rendering is Python code holding the
#: GIL: a second thread would add no throughput, only another contender the event loop
#: waits behind for the GIL.
RENDER_THREADS: Final = 1


def max_prompt_chars(max_model_len: int, max_chars_per_token: int) -> int:
    """The most characters a prompt may have and still fit ``max_model_len`` tokens with
    room for one output token."""
    return max(max_model_len - 1, 0) * max_chars_per_token


def check_prompt_chars(length: int, field: str, *, max_model_len: int,
                       max_chars_per_token: int, at_least: bool = False) -> None:
    """Refuse a prompt text of ``length`` characters that cannot fit the context.

    Raises:
        InvalidRequestError: naming ``field``, with vLLM's message ("You passed N input
            characters ... Please reduce the length of the input prompt."); ``at_least``:
            the text is longer than ``length`` (a rendering stopped there).
    """
    limit = max_prompt_chars(max_model_len, max_chars_per_token)
    if length > limit:
        passed = f"more than {limit}" if at_least else str(length)
        raise InvalidRequestError(
            field, f"You passed {passed} input characters and requested 1 output tokens. "
            f"However, the model's context length is only {max_model_len} tokens, "
            f"resulting in a maximum input length of {max_model_len - 1} tokens "
            f"(at most {limit} characters). Please reduce the length of the input prompt.")


@final
class Offload:
    """Worker threads for one :class:`TextClient`'s templates and encodings (package
    internal; :meth:`TextClient.encode` is the public way in)."""

    __slots__ = ("_encoding", "_rendering", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._encoding: anyio.CapacityLimiter | None = None
        self._rendering: anyio.CapacityLimiter | None = None

    async def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``tokenizer.encode(text)``, in a worker thread unless ``text`` is short.

        Raises:
            TypeError, InvalidRequestError: what :meth:`Tokenizer.encode` raises.
        """
        tokenizer = self._tokenizer
        if not isinstance(text, str) or len(text) <= ENCODE_INLINE_CHARS:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if self._encoding is None:
            self._encoding = anyio.CapacityLimiter(ENCODE_THREADS)
        return await anyio.to_thread.run_sync(
            functools.partial(tokenizer.encode, text, add_special_tokens=add_special_tokens),
            limiter=self._encoding)

    async def render(self, messages: Any, *, add_generation_prompt: bool, max_chars: int,
                     template_kwargs: dict[str, Any]) -> str:
        """``tokenizer.apply_chat_template(...)`` in a worker thread, its output held to
        ``max_chars`` characters.

        Raises:
            ChatTemplateError, InvalidRequestError: what
                :meth:`Tokenizer.apply_chat_template` raises (a ``RenderLimitError`` when
                the template went past its budget or ``max_chars``).
        """
        if self._rendering is None:
            self._rendering = anyio.CapacityLimiter(RENDER_THREADS)
        call = functools.partial(self._tokenizer.apply_chat_template, messages,
                                 add_generation_prompt=add_generation_prompt,
                                 max_chars=max_chars, **template_kwargs)
        return await anyio.to_thread.run_sync(call, limiter=self._rendering)


async def encode_request(offload: Offload, tokenizer: Tokenizer, request: TextRequest, *,
                         max_model_len: int, allow_empty: bool = False
                         ) -> tuple[str | None, list[int]]:
    """The prompt text (None for token ids) and token ids of a checked ``request``, as
    entering its stream makes them: refused by the context's character bound first, then
    rendered and encoded off the event loop.

    Raises:
        InvalidRequestError: the text cannot fit the context (vLLM's message), encodes to no
            tokens (unless ``allow_empty``), or malformed ``messages``.
        ChatTemplateError: no chat template, or it failed or went past its budget.
    """
    if request.prompt_token_ids is not None:
        return None, list(request.prompt_token_ids)
    per_token = tokenizer.max_chars_per_token
    if request.messages is not None:
        field = "messages"
        limit = max_prompt_chars(max_model_len, per_token)
        try:
            text = await offload.render(
                request.messages, add_generation_prompt=request.add_generation_prompt,
                max_chars=limit, template_kwargs=dict(request.chat_template_kwargs or {}))
        except RenderLimitError as exc:
            if exc.kind != "output":
                raise
            check_prompt_chars(limit + 1, field, max_model_len=max_model_len,
                               max_chars_per_token=per_token, at_least=True)
            raise  # not reached: the check raises
        add = False if request.add_special_tokens is None else request.add_special_tokens
    else:
        assert request.prompt is not None
        field = "prompt"
        text = request.prompt
        check_prompt_chars(len(text), field, max_model_len=max_model_len,
                           max_chars_per_token=per_token)
        add = True if request.add_special_tokens is None else request.add_special_tokens
    ids = await offload.encode(text, add_special_tokens=add)
    if not ids and not allow_empty:
        raise InvalidRequestError(field, "encodes to no tokens (the prompt must not be "
                                  "empty)")
    return text, ids
