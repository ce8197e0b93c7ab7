"""Chat templates and tokenization off the event loop, and the context's character bound.

Rendering a chat template and encoding a long text are CPU work of unbounded length (a
template is a program; 1 MiB of text takes 1-2 s to encode): on the event loop they would
stall every other request, ``/health`` included. :class:`Offload` runs them in worker
threads, a few at a time (one :class:`anyio.CapacityLimiter` each), so a slow one delays only
its own request. A text of at most :data:`ENCODE_INLINE_CHARS` characters is encoded inline:
the thread hop (55-110 µs) and the loop's wait to take the GIL back cost more than
encoding it; a longer one is encoded in a thread (with the GIL released). The model's own
template over messages of at most :data:`RENDER_INLINE_CHARS` characters is first rendered
inline within :data:`RENDER_INLINE_SECONDS`, and only one that runs past that is rendered
again in the worker thread: the hop, and the GIL the worker then holds against the event
loop, cost a short chat more than its rendering does.

Before any of that, :func:`check_prompt_chars` refuses a text that cannot fit the context
whatever it encodes to (longer than ``(max_model_len - 1) * max_chars_per_token``
characters), as vLLM does, at the cost of a ``len()``; a template's output is held to the
same bound while it renders.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar, final

import anyio
import anyio.to_thread

from ..errors import InvalidRequestError
from ..protocol.validation import check_token_ids
from .request import TextRequest
from .template_sandbox import RenderLimitError
from .tokenizer import Tokenizer

T = TypeVar("T")

__all__ = ["DECODE_INLINE_TOKENS", "ENCODE_INLINE_CHARS", "ENCODE_THREADS", "RENDER_INLINE_CHARS",
           "RENDER_INLINE_SECONDS", "RENDER_THREADS", "TRUNCATED_RENDER_CHARS", "Offload",
           "check_prompt_chars", "max_prompt_chars", "truncation_length"]

#: Texts up to this many characters are encoded on the event loop: at 0.1-0.7 µs a
#: character (the bundled and the benchmarks' 32k tokenizers) about 0.1-0.7 ms, and at most
#: about 1.5 ms for the worst texts measured (one letter repeated, emoji, CJK; the first
#: time the tokenizer meets their words).
ENCODE_INLINE_CHARS: Final = 1024
#: Token sequences up to this long are checked and decoded on the event loop (about
#: 0.3 µs a token: 1.2 ms); a longer one in a worker thread (a hostile ``/detokenize`` of
#: 500,000 ids held /health 0.41-0.44 s on a quiet machine, 0.30 s after: the body's parse).
DECODE_INLINE_TOKENS: Final = 4096
#: Worker threads encoding at once (the encoding releases the GIL: they run in parallel).
ENCODE_THREADS: Final = 4
#: Worker threads rendering chat templates at once. Rendering is Python code holding the
#: GIL: a second thread would add no throughput, only another contender the event loop
#: waits behind for the GIL.
RENDER_THREADS: Final = 1
#: Messages of at most this many characters (their strings, the texts of their parts) are
#: rendered inline first, with the model's own template (not a request's), within
#: RENDER_INLINE_SECONDS: the event loop is held that long at most.
RENDER_INLINE_CHARS: Final = 8192
RENDER_INLINE_SECONDS: Final = 0.002


def max_prompt_chars(max_model_len: int, max_chars_per_token: int) -> int:
    """The most characters a prompt may have and still encode to at most ``max_model_len``
    tokens (vLLM 0.32's bound: ``max_model_len * max_chars_per_token``)."""
    return max(max_model_len, 0) * max_chars_per_token


def check_prompt_chars(length: int, field: str, *, max_model_len: int,
                       max_chars_per_token: int, at_least: bool = False) -> None:
    """Refuse a prompt text of ``length`` characters that cannot fit the context.

    Raises:
        InvalidRequestError: naming ``field``, with vLLM 0.32's message ("... your prompt
            contains N characters (more than M characters, which is the upper bound for K
            input tokens). Please reduce the length of the input prompt."); ``at_least``:
            the text is longer than ``length`` (a rendering stopped there).
    """
    limit = max_prompt_chars(max_model_len, max_chars_per_token)
    if length > limit:
        passed = (f"more than {limit} characters, which" if at_least else
                  f"{length} characters (more than {limit} characters, which")
        raise InvalidRequestError(
            field, f"This model's maximum context length is {max_model_len} tokens. "
            f"However, your prompt contains {passed} is the upper bound for "
            f"{max_model_len} input tokens{'' if at_least else ')'}. "
            f"Please reduce the length of the input prompt.")


#: With ``truncate_prompt_tokens``, how long a chat template's output may grow (it is cut
#: to the context's character bound before encoding): the template sandbox's value cap.
TRUNCATED_RENDER_CHARS: Final = 1 << 24


def truncation_length(request: TextRequest, max_model_len: int) -> int | None:
    """How many prompt tokens ``request`` keeps (None: all), as vLLM resolves
    ``truncate_prompt_tokens``: -1 is the context less one token for the output.

    Raises:
        InvalidRequestError: ``truncate_prompt_tokens`` above ``max_model_len`` (vLLM's
            message).
    """
    keep = request.truncate_prompt_tokens
    if keep is None:
        return None
    if keep < 0:
        return max(max_model_len - 1, 0)
    if keep > max_model_len:
        raise InvalidRequestError(
            "truncate_prompt_tokens", f"truncate_prompt_tokens={keep} cannot be greater than "
            f"max_total_tokens = {max_model_len}. Please request a smaller truncation size.")
    return keep


def _truncated(ids: list[int], keep: int | None, side: str | None) -> list[int]:
    """``ids`` cut to ``keep`` tokens: the last ones (``side`` "left", or None: vLLM's
    generating tokenizers truncate on the left) or the first ones ("right")."""
    if keep is None or keep >= len(ids):
        return ids
    if keep == 0:
        return []
    return ids[:keep] if side == "right" else ids[-keep:]


def _truncated_within_specials(ids: list[int], tokenizer: Tokenizer, keep: int) -> list[int]:
    """``ids`` (encoded with the special tokens) cut to ``keep`` tokens as the tokenizer's
    own truncation cuts them, which vLLM uses when no ``truncation_side`` is given: the
    special tokens (a BOS) stay and the text's tokens are cut on the left."""
    specials = tokenizer.encode("", add_special_tokens=True)
    head = 0
    while head < len(specials) and head < len(ids) and ids[head] == specials[head]:
        head += 1
    tail = len(specials) - head
    room = keep - head - tail
    if room <= 0:
        return _truncated(ids, keep, None)
    return [*ids[:head], *ids[head:len(ids) - tail][-room:], *ids[len(ids) - tail:]]


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

    async def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool,
                     field: str) -> str:
        """``token_ids`` checked against the vocabulary and decoded, in a worker thread
        unless there are at most :data:`DECODE_INLINE_TOKENS` of them.

        Raises:
            InvalidRequestError: a token id the vocabulary does not have (``field``, or
                ``field[i]``, named).
        """
        tokenizer = self._tokenizer

        def work() -> str:
            check_token_ids(token_ids, field, tokenizer.vocab_size)
            return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

        if len(token_ids) <= DECODE_INLINE_TOKENS:
            return work()
        return await self.run(work)

    async def run(self, work: Callable[[], T]) -> T:
        """``work()``: small tokenizer work a request brings (its ``bad_words``), in an
        encoding worker thread.

        Raises:
            Whatever ``work`` raises.
        """
        if self._encoding is None:
            self._encoding = anyio.CapacityLimiter(ENCODE_THREADS)
        return await anyio.to_thread.run_sync(work, limiter=self._encoding)

    async def run_python(self, work: Callable[[], T]) -> T:
        """``work()``: Python work that holds the GIL (a large response's rendering), in the
        thread that renders chat templates (one at a time: a second would only be another
        contender for the GIL the event loop needs). A cancellation leaves at once: ``work``
        runs on to its end in its thread and its result is dropped.

        Raises:
            Whatever ``work`` raises.
        """
        if self._rendering is None:
            self._rendering = anyio.CapacityLimiter(RENDER_THREADS)
        return await anyio.to_thread.run_sync(work, limiter=self._rendering,
                                              abandon_on_cancel=True)

    async def render(self, messages: Any, *, add_generation_prompt: bool, max_chars: int,
                     template_kwargs: dict[str, Any]) -> str:
        """``tokenizer.apply_chat_template(...)``, its output held to ``max_chars``
        characters: inline if it is short (see the module docstring), else in a worker
        thread. ``template_kwargs``: the template's variables (``chat_template``: the
        request's own template).

        Raises:
            ChatTemplateError, InvalidRequestError: what
                :meth:`Tokenizer.apply_chat_template` raises (a ``RenderLimitError`` when
                the template went past its budget or ``max_chars``).
        """
        variables = dict(template_kwargs)
        chat_template = variables.pop("chat_template", None)
        call = functools.partial(self._tokenizer.apply_chat_template, messages,
                                 add_generation_prompt=add_generation_prompt,
                                 chat_template=chat_template, max_chars=max_chars,
                                 variables=variables)
        if chat_template is None and _chars_within(messages, RENDER_INLINE_CHARS):
            try:
                return call(max_seconds=RENDER_INLINE_SECONDS)
            except RenderLimitError as exc:
                if exc.kind != "time":
                    raise
        return await self.run_python(call)


def _chars_within(value: Any, limit: int) -> bool:
    """Whether the strings in ``value`` (messages: mappings, lists and strings; anything
    else counts as one character) have at most ``limit`` characters together; stops
    counting past it."""
    left = limit
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            left -= len(item)
        elif isinstance(item, Mapping):
            todo.extend(item.values())
            left -= len(item)
        elif isinstance(item, list | tuple):
            todo.extend(item)
            left -= 1
        else:
            left -= 1
        if left < 0:
            return False
    return True


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
    keep = truncation_length(request, max_model_len)
    side = request.truncation_side
    if request.prompt_token_ids is not None:
        return None, _truncated(list(request.prompt_token_ids), keep, side)
    per_token = tokenizer.max_chars_per_token
    limit = max_prompt_chars(max_model_len, per_token)
    if request.messages is not None:
        field = "messages"
        try:
            text = await offload.render(
                request.messages, add_generation_prompt=request.add_generation_prompt,
                max_chars=limit if keep is None else TRUNCATED_RENDER_CHARS,
                template_kwargs=dict(request.chat_template_kwargs or {}))
        except RenderLimitError as exc:
            if exc.kind != "output" or keep is not None:
                raise
            check_prompt_chars(limit + 1, field, max_model_len=max_model_len,
                               max_chars_per_token=per_token, at_least=True)
            raise  # not reached: the check raises
        add = False if request.add_special_tokens is None else request.add_special_tokens
    else:
        assert request.prompt is not None
        field = "prompt"
        text = request.prompt
        if keep is None:
            check_prompt_chars(len(text), field, max_model_len=max_model_len,
                               max_chars_per_token=per_token)
        add = True if request.add_special_tokens is None else request.add_special_tokens
    if keep is not None and len(text) > limit:
        # As vLLM: a text that must be truncated anyway is first cut to the characters
        # that can hold the context's tokens, on the side truncation keeps, so encoding
        # it costs what a prompt that fits costs.
        text = text[:limit] if side == "right" else text[-limit:]
    ids = await offload.encode(text, add_special_tokens=add)
    if keep is not None and keep < len(ids):
        if side is None and add:
            ids = _truncated_within_specials(ids, tokenizer, keep)
        else:
            ids = _truncated(ids, keep, side)
    if not ids and not allow_empty:
        raise InvalidRequestError(field, "encodes to no tokens (the prompt must not be "
                                  "empty)")
    return text, ids
