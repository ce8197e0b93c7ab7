"""``bad_words``: words the model must not generate, as the token id sequences vLLM bans.

vLLM's ``SamplingParams.update_from_tokenizer`` (0.32) turns each word into one or two token
sequences: the word as it is (leading spaces stripped), and with one leading space when that
encodes to a different first token and as many tokens (the word in the middle of a text). The
engine then never samples the last token of a sequence after the others. This module is that
rule, sans-IO; the text layer runs it off the event loop when a request has bad words.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from ..errors import InvalidRequestError
from .tokenizer import Tokenizer

__all__ = ["MAX_BAD_WORDS", "bad_words_token_ids"]

#: The most token sequences the words may give (vLLM's ``VLLM_MAX_NUM_BAD_WORDS`` default).
MAX_BAD_WORDS: Final = 128


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]
                        ) -> tuple[tuple[int, ...], ...]:
    """The token id sequences that ``words`` ban, in vLLM's order.

    Raises:
        InvalidRequestError: ``bad_words``, in vLLM's words: an empty word, a word that
            encodes to no token; more than :data:`MAX_BAD_WORDS` sequences; a token outside the
            vocabulary.
    """
    if any(not word for word in words):
        raise InvalidRequestError("bad_words", "bad_words cannot contain an empty string.")
    found: list[list[int]] = []
    for word in dict.fromkeys(words):  # a repeated word once, as vLLM
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not prefix:
                    raise InvalidRequestError(
                        "bad_words", "bad_words entries must tokenize to at least one token.")
                continue  # the unprefixed form is still banned
            if not prefix or (ids[0] != found[-1][0] and len(ids) == len(found[-1])):
                found.append(ids)
                if len(found) > MAX_BAD_WORDS:
                    raise InvalidRequestError(
                        "bad_words", f"Too many bad words after tokenization: {len(found)}. "
                        f"The max number is {MAX_BAD_WORDS}.")
    top = tokenizer.vocab_size - 1
    invalid = [t for ids in found for t in ids if t < 0 or t > top]
    if invalid:
        raise InvalidRequestError(
            "bad_words", f"The model vocabulary size is {top + 1}, but the following tokens "
            f"were specified as bad: {invalid}. All token id values should be integers "
            f"satisfying: 0 <= token_id <= {top}.")
    return tuple(tuple(ids) for ids in found)
