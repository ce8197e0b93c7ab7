"""One request's token ids -> text, incrementally (sans-IO: no anyio, no zmq).

:class:`IncrementalDetokenizer` wraps ``tokenizers.decoders.DecodeStream`` exactly as vLLM
0.32's fast path does (seeded with the prompt ids, ``skip_special_tokens``, the raw added-token
text of ``spaces_between_special_tokens=False``, a bad id giving no text, the restart after the
library's "invalid prefix" error, no text for the tokens still pending at the end), and fixes
the two places where vLLM's text is wrong.

The guarantee. Let ``D(ids)`` be ``tokenizer.decode(ids, skip_special_tokens=...)``, ``P`` the
prompt, ``O`` the output ids passed to :meth:`~IncrementalDetokenizer.step`, ``P0`` the longest
prefix of ``P`` whose text does not end in U+FFFD (looked for among the last 16 cuts) and
``T = D(P)[k:]``, ``k`` the length of the common prefix of ``D(P)`` and ``D(P0)`` (what the
prompt's unfinished tail shows: U+FFFD).
Then the texts of all steps concatenate to ``D(P + O')[len(D(P0)):]`` less its common prefix
with ``T``, ``O'`` the longest prefix of ``O`` for which ``D(P + O')`` does not end in U+FFFD,
or the empty one (the tokens after it, whose text never ended cleanly, give none: vLLM 0.32's
rule, see :meth:`~IncrementalDetokenizer.finish`); when ``D(P)`` ends cleanly this is simply
``D(P + O')[len(D(P)):]``. It holds as long as ``decode`` never rewrites text it already
produced: always for byte-level BPE; for byte-fallback tokenizers unless a run of byte tokens
that spelled characters is continued into invalid UTF-8 (``ByteFallback`` then turns the whole
run, the characters included, into U+FFFD, which no stream can take back). A step's text is
``""`` while a character is incomplete: no U+FFFD in the middle of a stream, except for bytes
that really are invalid.

Where vLLM differs:

* A prompt whose text ends in U+FFFD (an incomplete character): ``DecodeStream`` then keeps no
  prefix, so vLLM's first output text repeats the whole prompt text. Here the stream is seeded
  with the longest prompt prefix whose text ends cleanly, the rest of the prompt is fed as
  pending tokens, and the prompt's trailing U+FFFD chars are not repeated unless the output
  changes them (it completes the character).
* The "invalid prefix" restart: vLLM restarts the stream empty with only the failing token,
  losing the pending tokens' text and, for decoders that strip the first space (``Strip``,
  ``Metaspace``), the token's leading space. Here the new stream is seeded with the last
  emitted tokens and a separator token (:func:`separator_token_id`), and the pending tokens
  are replayed, so nothing is lost.
* A skipped special token (``skip_special_tokens``) stays in vLLM's stream window until text
  comes, so a run of them (a model emitting ``<unk>``) makes each step decode a longer
  window: quadratic. Here it is not fed to the stream at all, which decodes the same text
  (the library drops such tokens before its decoders).

Byte-level BPE (a decoder that is exactly ``ByteLevel``: GPT-2, Llama 3, Qwen, the shipped
tokenizer) does not go through ``DecodeStream``: each step appends the id's bytes from a
:class:`~.byte_table.ByteTable` and decodes them once they end cleanly, which is what the
stream emits for such a decoder (the same text step by step; tested against the stream
with hypothesis), at a fraction of a step's cost. The prompt's corners
above are handled the same way in both.

Byte fallback (a decoder that is exactly ``Replace("▁", " ")``, ``ByteFallback``, ``Fuse``
and optionally ``Strip(left 1)``: Llama 2, Mistral, Gemma) steps on a
:class:`~.fallback_table.FallbackStream` in place of ``DecodeStream``: each id's piece from a
table, the open run of byte pieces decoded once it is valid UTF-8, the first space stripped;
its steps give what the ``DecodeStream`` path gives, the restart above included (tested with
hypothesis), without decoding the window again at every token.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Final

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from .byte_table import ByteTable, byte_table
from .fallback_table import FallbackStream, fallback_table
from .separator import separator_token_id

__all__ = ["INVALID_PREFIX", "IncrementalDetokenizer", "clean_prompt_split",
           "separator_token_id"]

#: How the ``tokenizers`` error vLLM recovers from starts.
INVALID_PREFIX: Final = "Invalid prefix encountered"
REPLACEMENT: Final = "\ufffd"
#: How many trailing prompt tokens are searched for the clean seed (then: the whole prompt).
MAX_PROMPT_TAIL: Final = 16


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def clean_prompt_split(tokenizer: Tokenizer, prompt: Sequence[int],
                       skip_special_tokens: bool) -> tuple[list[int], list[int], str]:
    """``(seed, tail, tail_text)``: the prompt split where its text last ended cleanly.

    ``seed`` is the longest prefix (of the last :data:`MAX_PROMPT_TAIL` cuts) whose text does
    not end in U+FFFD, ``tail`` the rest, ``tail_text`` what ``tail`` adds to the prompt's text.
    A prompt whose text ends cleanly gives ``(prompt, [], "")``.
    """
    ids = list(prompt)
    whole = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if not whole.endswith(REPLACEMENT):
        return ids, [], ""
    for cut in range(len(ids) - 1, max(len(ids) - MAX_PROMPT_TAIL, 0) - 1, -1):
        head = tokenizer.decode(ids[:cut], skip_special_tokens=skip_special_tokens)
        if not head.endswith(REPLACEMENT):
            return ids[:cut], ids[cut:], whole[_common_prefix(whole, head):]
    return [], ids, whole


def _ends_cleanly(table: ByteTable, prompt: Sequence[int]) -> bool:
    """Whether the byte-level prompt's text does not end in U+FFFD, from its last 4 bytes
    (the text's last character or replaced run starts within them, at a byte the decoding
    of any suffix holding it also starts a unit at); False when unsure (a bad id)."""
    raw = table.raw
    tail = b""
    try:
        for token_id in reversed(prompt):
            if token_id < 0:
                return False
            data = raw[token_id]
            if data is None:
                data = table.fill(token_id)
            tail = data + tail
            if len(tail) >= 4:
                break
    except (IndexError, TypeError):
        return False
    return not tail.decode("utf-8", "replace").endswith(REPLACEMENT)


class IncrementalDetokenizer:
    """The text of one request's output tokens, one token at a time.

    ``tokenizer`` is the fast tokenizer (``Tokenizer.backend``); ``prompt_token_ids`` seed the
    stream so the first output token decodes in the prompt's context.
    ``spaces_between_special_tokens=False`` only matters with ``skip_special_tokens=False``:
    an added token right after another one is then emitted as its raw content (vLLM's rule).
    """

    __slots__ = ("_added", "_context", "_finished", "_held", "_last", "_last_added",
                 "_pending", "_plain", "_raw", "_skip", "_skipped", "_slow", "_stream",
                 "_table", "_tail_text", "_texts", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._table = table = byte_table(tokenizer, skip_special_tokens)
        seed: list[int]
        tail: list[int]
        if table is not None and _ends_cleanly(table, prompt_token_ids):
            seed, tail, tail_text = list(prompt_token_ids), [], ""  # without a full decode
        else:
            seed, tail, tail_text = clean_prompt_split(tokenizer, prompt_token_ids,
                                                       skip_special_tokens)
        # Byte-level: the table's bytes instead of a stream (``_raw`` is None otherwise);
        # ``_held`` are the bytes since the last text (the seed's text ends cleanly).
        self._raw = table.raw if table is not None else None
        self._texts: list[str | None] = table.texts if table is not None else []
        self._held = b""
        self._plain = False  # byte-level without corners: step() reads the table itself
        self._stream: DecodeStream | FallbackStream | None = None
        if table is None:
            fallback = fallback_table(tokenizer, skip_special_tokens)
            self._stream = FallbackStream(fallback, seed) if fallback is not None else \
                DecodeStream(ids=seed, skip_special_tokens=skip_special_tokens)
        # The ids a library stream is not stepped on: a skipped special token adds nothing
        # to any decode (the library drops it before the decoders), but kept in the stream's
        # window it makes every later step decode a longer one: a run of them (a model
        # emitting <unk>) was quadratic, 4,000 of them 0.5 s, 16,000 8 s.
        self._skipped: frozenset[int] = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        ) if skip_special_tokens and isinstance(self._stream, DecodeStream) else frozenset()
        # The stream's prefix is the text of [_last] if _last >= 0, else of _context.
        self._context: list[int] = seed
        self._last = -1
        self._pending: list[int] = []    # ids fed since the stream last produced text
        self._finished = False
        self._added: dict[int, str] | None = None
        self._last_added = False
        self._tail_text = tail_text  # prompt text (U+FFFD) the first outputs must not repeat
        for token_id in tail:  # pending prompt bytes: their text is the prompt's, not ours
            self._strip_tail(self._plain_step(token_id))
        if not skip_special_tokens and not spaces_between_special_tokens:
            added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
            self._added = added or None
        self._set_mode()

    @property
    def finished(self) -> bool:
        """True once :meth:`finish` was called."""
        return self._finished

    def step(self, token_id: int) -> str:
        """The text new with this token (``""`` while a character is incomplete).

        A bad id (negative, too large for the library, not an int) gives ``""``.
        Raises RuntimeError after :meth:`finish`.
        """
        if self._plain:  # byte-level: a token that decodes on its own, or the bytes
            if not self._held:
                try:
                    text = self._texts[token_id]
                    if text is not None and token_id >= 0:
                        return text
                except (IndexError, TypeError):
                    pass  # a bad id: the byte step says what it gives
            return self._byte_step(token_id)
        if self._slow:
            return self._slow_step(token_id)
        return self._stream_step(token_id)

    def finish(self) -> None:
        """The request ended: the tokens still pending (whose text does not end cleanly: an
        unfinished character, or invalid bytes, at the end) give no text, as vLLM 0.32 gives
        none (its ``DecodeStream`` step returned None for them and nothing flushes it).
        A whole character that came with them in the same token is dropped too, as vLLM
        drops it: a byte-level token such as ``b" \\xd0"`` (a space and a Cyrillic lead byte)
        shows nothing, not even the space, unless a later token finishes its character.
        The detokenizer takes no more tokens afterwards.
        """
        self._finished = True
        self._slow = True
        self._plain = False
        self._held = b""
        self._pending = []

    # -- internals ------------------------------------------------------------------------

    def _set_mode(self) -> None:
        """Which path :meth:`step` takes next: byte-level or the stream, or with a corner (the
        prompt's tail, raw added tokens, finished) the general one."""
        corner = bool(self._tail_text) or self._added is not None or self._finished
        self._plain = self._raw is not None and not corner
        self._slow = corner

    def _byte_step(self, token_id: int) -> str:
        """The byte-level step: the id's bytes after the held ones, text once they end
        cleanly (not in U+FFFD), as ``DecodeStream`` emits it."""
        try:
            data = self._raw[token_id]  # type: ignore[index]
            if token_id < 0:
                return ""
        except IndexError:  # past the table: what the library makes of it (mostly nothing)
            data = self._table.fill(token_id)  # type: ignore[union-attr]
        except TypeError:  # not an int: one with __index__ counts as its value
            try:
                index = operator.index(token_id)
            except TypeError:
                return ""
            return self._byte_step(index)
        if data is None:  # the first time this id is met
            data = self._table.fill(token_id)  # type: ignore[union-attr]
        if not data:
            return ""
        held = self._held
        if held:
            data = held + data
        text = data.decode("utf-8", "replace")
        if text.endswith(REPLACEMENT):
            self._held = data
            return ""
        self._held = b""
        return text

    def _plain_step(self, token_id: int) -> str:
        if self._raw is not None:
            return self._byte_step(token_id)
        return self._stream_step(token_id)

    def _stream_step(self, token_id: int) -> str:
        """One token through the library's ``DecodeStream`` (any decoder)."""
        if type(token_id) is int and token_id in self._skipped:
            return ""
        try:
            text = self._stream.step(self._tokenizer, token_id)  # type: ignore[union-attr]
        except Exception as exc:  # the library raises a plain Exception
            return self._failed_step(token_id, exc)
        if text is None:
            self._pending.append(token_id)
            return ""
        if self._pending:
            self._pending.append(token_id)
            self._context, self._pending, self._last = self._pending, [], -1
        else:
            self._last = token_id
        return text

    def _slow_step(self, token_id: int) -> str:
        if self._finished:
            raise RuntimeError("the detokenizer is finished: it takes no more tokens")
        text = self._plain_step(token_id)
        if self._tail_text and text:
            text = self._strip_tail(text)
        if self._added is not None:
            content = self._added.get(token_id)
            if content is not None and self._last_added:
                text = content
            self._last_added = content is not None
        self._set_mode()
        return text

    def _strip_tail(self, text: str) -> str:
        """Drop what the text shares with the prompt's unfinished tail (corner 1)."""
        tail = self._tail_text
        if not tail:
            return text
        n = _common_prefix(text, tail)
        self._tail_text = tail[n:] if n == len(text) else ""
        return text[n:]

    def _failed_step(self, token_id: int, exc: Exception) -> str:
        if isinstance(exc, OverflowError | TypeError):
            return ""  # a bad id: no text (vLLM's rule); the stream did not take it
        if not str(exc).startswith(INVALID_PREFIX):
            raise exc
        return self._restart(token_id)

    def _context_ids(self) -> list[int]:
        return [self._last] if self._last >= 0 else self._context

    def _separator(self) -> list[int]:
        sep = separator_token_id(self._tokenizer)
        return [] if sep is None else [sep]

    def _restart(self, token_id: int) -> str:
        """Restart the stream after the last emitted text and replay the pending tokens."""
        replay = [*self._pending, token_id]
        seed = self._context_ids() + self._separator()
        self._stream = DecodeStream(ids=seed, skip_special_tokens=self._skip)
        self._context, self._pending, self._last = seed, [], -1
        pieces = []
        for replayed in replay:
            try:
                text = self._stream.step(self._tokenizer, replayed)
            except Exception as exc:  # a second failure: start from nothing
                if not str(exc).startswith(INVALID_PREFIX):
                    raise
                self._stream = DecodeStream(skip_special_tokens=self._skip)
                self._context, self._pending = [], []
                text = self._stream.step(self._tokenizer, replayed)
            self._pending.append(replayed)
            if text is not None:
                pieces.append(text)
                self._context, self._pending = self._pending, []
        return "".join(pieces)
