"""A separator token: a plain vocabulary token whose text does not depend on its
neighbours, which ends a run of byte-fallback pieces and keeps a decoder's first-space
stripping away from the text after it (the detokenizer's "invalid prefix" recovery and the
byte-fallback table both need one)."""

from __future__ import annotations

from typing import Final

from tokenizers import Tokenizer

__all__ = ["SEPARATORS", "separator_token_id"]

#: Separator candidates, first match wins: plain one-character tokens.
SEPARATORS: Final = (".", ",", "a", "0", "!", "-", "x")
_REPLACEMENT: Final = "\ufffd"


def separator_token_id(tokenizer: Tokenizer) -> int | None:
    """A plain vocabulary token whose text does not depend on its neighbours, or ``None``.

    Used after an "invalid prefix" error: it ends a run of byte-fallback tokens and keeps a
    decoder's first-space stripping away from the text that follows it.
    """
    added = tokenizer.get_added_tokens_decoder()
    for candidate in SEPARATORS:
        token_id = tokenizer.token_to_id(candidate)
        if token_id is None or token_id in added:
            continue
        one = tokenizer.decode([token_id])
        if one and not one.endswith(_REPLACEMENT) and \
                tokenizer.decode([token_id, token_id]) == one + one:
            return token_id
    return None
