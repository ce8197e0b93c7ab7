"""Sample and prompt logprobs with their token strings, as vLLM's logprobs processor decodes
them.

Each candidate id is decoded alone (:meth:`Tokenizer.token_strings`); a string that ends in
U+FFFD (part of a character whose bytes are split across tokens) is decoded again in the
context of the up to 4 tokens before its position, as vLLM 0.32's ``LogprobsProcessor``
(``vllm/v1/engine/logprobs.py``, ``_verify_tokens``) does: the text it completes with them,
or ``""`` when it completes none (always at the first position: no context there). For
sample logprobs the context is the sampled tokens before the position; for prompt logprobs
it is the prompt tokens of the rows before it, so the prompt's first token (which has no
row) is never context.
"""

from __future__ import annotations

from typing import Final

from ..protocol import Logprobs
from .output import LogprobRows
from .tokenizer import Tokenizer

__all__ = ["LogprobsDecoder", "prompt_logprob_rows"]

#: Sampled tokens before a position that can complete its character (UTF-8: 4 bytes).
_CONTEXT: Final = 4
_REPLACEMENT: Final = "\ufffd"


class LogprobsDecoder:
    """One request's sample logprobs as :class:`.LogprobRows` (it keeps the context).

    With ``detokenize=False`` the token strings are ``""`` (vLLM gives None there).
    """

    __slots__ = ("_detokenize", "_recent", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, *, detokenize: bool = True) -> None:
        self._tokenizer = tokenizer
        self._detokenize = detokenize
        self._recent: list[int] = []

    def decode(self, logprobs: Logprobs, keep: int) -> LogprobRows:
        """Per kept position (the first ``keep``): the sampled token, then the top ones."""
        ids = logprobs.token_ids[:keep]
        if ids.ndim != 2 or not ids.shape[0]:
            return LogprobRows(0, [], [], [], [])
        rows, cols = ids.shape
        flat: list[int] = ids.ravel().tolist()
        values: list[float] = logprobs.logprobs[:keep].ravel().tolist()
        ranks: list[int] = logprobs.ranks[:keep].tolist()
        strings = (self._tokenizer.token_strings(flat) if self._detokenize
                   else [""] * len(flat))
        recent = self._recent
        for row in range(rows):
            base = row * cols
            if self._detokenize and any(s.endswith(_REPLACEMENT)
                                        for s in strings[base:base + cols]):
                strings[base:base + cols] = self._tokenizer.token_strings(
                    flat[base:base + cols], context=recent[-_CONTEXT:])
            recent.append(flat[base])
        if len(recent) > _CONTEXT:
            del recent[:-_CONTEXT]
        return LogprobRows(cols, flat, values, ranks, strings)


def prompt_logprob_rows(tokenizer: Tokenizer, logprobs: Logprobs, *,
                        detokenize: bool = True) -> LogprobRows:
    """Prompt logprobs (one row per prompt position but the first: the prompt's token, then
    the top ones) as :class:`.LogprobRows`, each id decoded as vLLM decodes prompt
    logprobs: alone, and a string ending in U+FFFD again in the context of the prompt
    tokens of the up to 4 rows before (``""`` if it completes no character with them)."""
    ids = logprobs.token_ids
    if ids.ndim != 2 or not ids.shape[0]:
        return LogprobRows(0, [], [], [], [])
    rows, cols = ids.shape
    flat: list[int] = ids.ravel().tolist()
    values: list[float] = logprobs.logprobs.ravel().tolist()
    ranks: list[int] = logprobs.ranks.tolist()
    strings = tokenizer.token_strings(flat) if detokenize else [""] * len(flat)
    if detokenize:
        for row in range(rows):
            base = row * cols
            if any(s.endswith(_REPLACEMENT) for s in strings[base:base + cols]):
                context = flat[max(row - _CONTEXT, 0) * cols:base:cols]  # the rows' first ids
                strings[base:base + cols] = tokenizer.token_strings(flat[base:base + cols],
                                                                    context=context)
    return LogprobRows(cols, flat, values, ranks, strings)
