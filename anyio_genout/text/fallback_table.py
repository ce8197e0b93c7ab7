"""Byte-fallback (SentencePiece-style) decoding from a table of each token's piece (sans-IO).

A tokenizer whose decoder is exactly Llama 2's / Mistral's ``Sequence[Replace("▁", " "),
ByteFallback, Fuse, Strip(" ", 1, 0)]`` (or Gemma's, without the ``Strip``) decodes ids as
the Rust library does:

* each id's token string (special tokens dropped with ``skip_special_tokens``, unknown ids
  dropped) has its ``"▁"`` replaced by ``" "``;
* a run of consecutive byte pieces (``<0xAB>``: six characters, the byte in hex) becomes the
  text of its bytes if they are valid UTF-8, else one U+FFFD per piece;
* everything is joined, and one leading space of the whole text is stripped.

:class:`FallbackStream` steps on this as ``DecodeStream.step`` does, with the
:class:`~.detokenizer.IncrementalDetokenizer`'s restart after an "invalid prefix" (a run
that spelled characters continued into invalid bytes: the stream's whole run turns to
U+FFFD, so the detokenizer restarts after the emitted text, behind a separator, and replays
the pending pieces): its text for each step is the detokenizer's over ``DecodeStream``
(tested with hypothesis), without decoding the window again at each token. A step's text is
``None`` while the pending text is empty or ends in U+FFFD, as the stream's.

:func:`fallback_table` gives one table per ``tokenizers.Tokenizer`` object and
``skip_special_tokens``, filled as ids are met (as :func:`.byte_table.byte_table`).
"""

from __future__ import annotations

import json
import operator
import re
import weakref
from collections.abc import Sequence
from typing import Final, final

from tokenizers import Tokenizer, decoders

from .separator import separator_token_id

__all__ = ["FallbackStream", "FallbackTable", "fallback_table"]

REPLACEMENT: Final = "\ufffd"
#: The library's byte piece: ``<0x`` + two characters ``u8::from_str_radix`` reads + ``>``.
_BYTE_PIECE: Final = re.compile(r"<0x(\+[0-9A-Fa-f]|[0-9A-Fa-f]{2})>")
_ID_LIMIT: Final = 2**32
_REPLACE: Final = {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}
_STRIP: Final = {"type": "Strip", "content": " ", "start": 1, "stop": 0}
_FALLBACK: Final = [_REPLACE, {"type": "ByteFallback"}, {"type": "Fuse"}]


def _decoder_kind(tokenizer: Tokenizer) -> bool | None:
    """``True``/``False``: the byte-fallback decoder with/without the ``Strip``; ``None``:
    another decoder."""
    decoder = tokenizer.decoder
    if type(decoder) is not decoders.Sequence:
        return None
    try:
        parts = json.loads(decoder.__getstate__())["decoders"]
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if parts == _FALLBACK:
        return False
    if parts == [*_FALLBACK, _STRIP]:
        return True
    return None


@final
class FallbackTable:
    """One tokenizer's ids as the byte-fallback decoder reads them, filled as ids are met.

    Per id below ``len(table)``: ``pieces[id]`` is ``None`` until :meth:`fill`, then the
    byte of a byte piece (an int), else the token's text with ``"▁"`` as ``" "`` (``""`` for
    a special token that is skipped).
    """

    __slots__ = ("_skip", "_specials", "_tokenizer", "pieces", "strip")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, strip: bool) -> None:
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.pieces: Final[list[str | int | None]] = [None] * size
        self.strip: Final = strip
        self._tokenizer = weakref.ref(tokenizer)
        self._skip = skip_special_tokens
        self._specials = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        ) if skip_special_tokens else frozenset()

    def __len__(self) -> int:
        return len(self.pieces)

    def fill(self, token_id: int) -> str | int:
        """The piece of one non-negative id below 2**32 (``""`` for an unknown id), kept in
        :attr:`pieces` when the id is below ``len(self)``."""
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("the tokenizer of this table is gone")
        token = tokenizer.id_to_token(token_id)
        piece: str | int
        if token is None or token_id in self._specials:
            piece = ""
        else:
            found = _BYTE_PIECE.fullmatch(token)
            piece = int(found.group(1), 16) if found else token.replace("\u2581", " ")
        if token_id < len(self.pieces):
            self.pieces[token_id] = piece
        return piece


#: Per tokenizer: per ``skip_special_tokens``, its table (rebuilt when the size changed).
_CACHE: weakref.WeakKeyDictionary[Tokenizer, dict[bool, FallbackTable]] = \
    weakref.WeakKeyDictionary()


def fallback_table(tokenizer: Tokenizer, skip_special_tokens: bool) -> FallbackTable | None:
    """The tokenizer's table, or ``None`` if its decoder is not exactly the byte-fallback
    sequence (or it has no separator token for the detokenizer's restart)."""
    tables = _CACHE.get(tokenizer)
    if tables is None:
        strip = _decoder_kind(tokenizer)
        if strip is None or separator_token_id(tokenizer) is None:
            return None
        tables = _CACHE.setdefault(tokenizer, {})
    table = tables.get(skip_special_tokens)
    if table is None or len(table) != tokenizer.get_vocab_size(with_added_tokens=True):
        strip = _decoder_kind(tokenizer)
        if strip is None:  # the decoder was changed
            del _CACHE[tokenizer]
            return None
        table = tables[skip_special_tokens] = FallbackTable(tokenizer, skip_special_tokens,
                                                            strip)
    return table


@final
class FallbackStream:
    """``DecodeStream`` over a :class:`FallbackTable`, seeded with ``ids`` (whose text must
    end cleanly: the detokenizer's seed). ``step(tokenizer, id)`` returns the new text or
    ``None``; a negative id or one from 2**32 raises :class:`OverflowError`, a non-int
    :class:`TypeError`, as the library's step does."""

    __slots__ = ("_count", "_held", "_pieces", "_strip", "_table", "_text")

    def __init__(self, table: FallbackTable, ids: Sequence[int]) -> None:
        self._table = table
        self._pieces = table.pieces
        self._text = ""         # pending text (closed runs, pieces) since the last emission
        self._held = bytearray()  # the open run of byte pieces, pending
        self._count = 0         # pieces in the open run
        # The decoder strips one leading space of the text: the first one, if the seed
        # contributes no piece at all.
        self._strip = table.strip and not any(self._piece(i) != "" for i in ids)

    def _piece(self, token_id: int) -> str | int:
        try:
            piece = self._pieces[token_id]
        except (IndexError, TypeError):
            index = operator.index(token_id)  # TypeError for a non-int
            if index < 0 or index >= _ID_LIMIT:
                raise OverflowError("token id out of range") from None
            return self._table.fill(index)
        if token_id < 0:
            raise OverflowError("token id out of range")
        if piece is None:
            piece = self._table.fill(token_id)
        return piece

    def step(self, tokenizer: object, token_id: int) -> str | None:
        """The text new with ``token_id``, or ``None`` while it is pending."""
        piece = self._piece(token_id)
        if piece.__class__ is str:
            if not piece:
                return None  # contributes nothing (a skipped special, an unknown id)
            if not self._count and not self._text and not self._strip and \
                    not piece.endswith(REPLACEMENT):
                return piece
            text = self._text
            if self._count:  # the piece ends the run of byte pieces
                try:
                    text += self._held.decode()
                except UnicodeDecodeError:
                    text += REPLACEMENT * self._count
                self._held = bytearray()
                self._count = 0
            text += piece
            return self._emit(text, text)
        self._held.append(piece)  # type: ignore[arg-type]
        self._count += 1
        try:
            run = self._held.decode()
        except UnicodeDecodeError:
            return None  # unfinished or invalid: the stream's run is all U+FFFD for now
        return self._emit(self._text, self._text + run)

    def _emit(self, pending: str, text: str) -> str | None:
        """Emit ``text`` (the pending text, the open run's included) unless it is empty or
        ends in U+FFFD; ``pending`` is what stays pending apart from the open run then."""
        shown = text[1:] if self._strip and text.startswith(" ") else text
        if not shown or shown.endswith(REPLACEMENT):
            self._text = pending
            return None
        self._strip = False
        self._text = ""
        self._held = bytearray()
        self._count = 0
        return shown
