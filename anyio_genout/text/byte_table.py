"""Byte-level BPE decoding from a table of each token's bytes (sans-IO).

A tokenizer whose decoder is exactly ``tokenizers.decoders.ByteLevel`` (GPT-2, Llama 3, Qwen
and the shipped tokenizer) decodes ids as the Rust library does, checked empirically against
``tokenizers`` 0.23 (``tests/text/test_detokenizer.py``):

* each id's token string is the added token's content, else the model's token;
* with ``skip_special_tokens`` the ids of special tokens contribute nothing;
* a token whose characters are all in the byte-level alphabet (GPT-2's ``bytes_to_unicode``)
  contributes the bytes they stand for; a token with any other character contributes its
  raw UTF-8 (added tokens included: they go through the decoder too);
* the bytes of all ids are concatenated and decoded once, invalid sequences replaced by
  U+FFFD per maximal subpart (Rust's ``from_utf8_lossy``, which Python's ``"replace"``
  equals; tested over random bytes).

So ``decode(ids) == b"".join(raw[i] for i in ids).decode("utf-8", "replace")``, and a
``DecodeStream`` step emits the pending bytes' text once it is non-empty and does not end in
U+FFFD (text that ends cleanly ends on a character boundary, so what follows decodes on its
own). :class:`~.detokenizer.IncrementalDetokenizer` steps on this table instead of the
stream's full re-decode.

:func:`byte_table` gives one table per ``tokenizers.Tokenizer`` object and
``skip_special_tokens`` (kept while the tokenizer lives; a new one if its vocabulary size
changes, e.g. after ``add_tokens``). Each id's entry is filled the first time it is met, so a
large vocabulary costs nothing up front (reading all 150k tokens of a Llama 3 vocabulary
would stall the first request for about 0.3 s).
"""

from __future__ import annotations

import codecs
import weakref
from typing import Final, final

from tokenizers import Tokenizer, decoders

__all__ = ["ByteTable", "byte_table", "token_bytes"]

REPLACEMENT: Final = "\ufffd"


def _bytes_to_unicode() -> str:
    """GPT-2's byte -> character map, as a string indexed by byte: printable bytes stand for
    themselves, the rest for U+0100 onwards (the ``ByteLevel`` pre-tokenizer's alphabet)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(0x100, 0x200))
    return "".join(chr(b) if b in printable else chr(next(extra)) for b in range(256))


_ALPHABET: Final = codecs.charmap_build(_bytes_to_unicode())  # character -> byte, in C
_charmap_encode = codecs.charmap_encode


def token_bytes(token: str) -> bytes:
    """The bytes the ``ByteLevel`` decoder gives for one token string."""
    try:
        return _charmap_encode(token, "strict", _ALPHABET)[0]
    except UnicodeEncodeError:  # a character outside the alphabet: the token as it is
        return token.encode()


@final
class ByteTable:
    """One tokenizer's ids as the ``ByteLevel`` decoder reads them, filled as ids are met.

    Per id below ``len(table)``: ``raw[id]``, the bytes it contributes (``None`` until
    :meth:`fill`), and ``texts[id]``, its text when no bytes are pending (set by
    :meth:`fill`: the bytes decoded, unless that ends in U+FFFD; ``None`` then, or before).
    """

    __slots__ = ("_contents", "_skip", "_tokenizer", "raw", "texts")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.raw: Final[list[bytes | None]] = [None] * size
        self.texts: Final[list[str | None]] = [None] * size
        self._tokenizer = weakref.ref(tokenizer)
        self._skip = skip_special_tokens
        # Skipping goes by content (an id whose string is a special token's): the ids whose
        # string is an added token's are probed with a one-id decode.
        self._contents = frozenset(
            t.content for t in tokenizer.get_added_tokens_decoder().values()
        ) if skip_special_tokens else frozenset()

    def __len__(self) -> int:
        return len(self.raw)

    def fill(self, token_id: int) -> bytes:
        """The bytes of one id (none for an id the tokenizer does not know, or a negative
        one), kept in :attr:`raw` and :attr:`texts` when the id is below ``len(self)``."""
        if token_id < 0:
            return b""
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("the tokenizer of this byte table is gone")
        try:
            token = tokenizer.id_to_token(token_id)
        except (OverflowError, TypeError):  # beyond what the library takes
            token = None
        data = b"" if token is None else token_bytes(token)
        if data and token in self._contents and \
                tokenizer.decode([token_id], skip_special_tokens=True) == "":
            data = b""  # a special token, skipped
        if token_id < len(self.raw):
            self.raw[token_id] = data
            text = data.decode("utf-8", "replace")
            self.texts[token_id] = None if text.endswith(REPLACEMENT) else text
        return data


#: Per tokenizer: per ``skip_special_tokens``, its table (rebuilt when the size changed).
_CACHE: weakref.WeakKeyDictionary[Tokenizer, dict[bool, ByteTable]] = \
    weakref.WeakKeyDictionary()


def byte_table(tokenizer: Tokenizer, skip_special_tokens: bool) -> ByteTable | None:
    """The tokenizer's table, or ``None`` if its decoder is not exactly ``ByteLevel``."""
    if type(tokenizer.decoder) is not decoders.ByteLevel:
        return None
    tables = _CACHE.setdefault(tokenizer, {})
    table = tables.get(skip_special_tokens)
    if table is None or len(table) != tokenizer.get_vocab_size(with_added_tokens=True):
        table = tables[skip_special_tokens] = ByteTable(tokenizer, skip_special_tokens)
    return table
