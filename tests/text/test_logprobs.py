"""Logprob token strings: sample and prompt logprobs decoded as vLLM 0.32 decodes them.

The expected strings are vLLM's own (``LogprobsProcessor`` of ``vllm/v1/engine/logprobs.py``,
with the shipped tokenizer): from the side-by-side differential against ``vllm serve`` and
from vLLM's processor fed the same rows. A token that is part of a character (its text alone
ends in U+FFFD) shows the character it completes with the up to 4 tokens before it, else
``""``: never U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from anyio_genout.protocol import Logprobs
from anyio_genout.text.bundled import bundled_tokenizer
from anyio_genout.text.logprobs import LogprobsDecoder, prompt_logprob_rows


def rows(ids: Sequence[Sequence[int]]) -> Logprobs:
    array = np.array(ids, dtype=np.int64)
    return Logprobs(array, np.full(array.shape, -1.0, np.float32),
                    np.ones(len(array), np.int32))


def prompt_strings(ids: Sequence[Sequence[int]]) -> list[list[str]]:
    return [[entry.token for entry in row]
            for row in prompt_logprob_rows(bundled_tokenizer(), rows(ids))]


def test_completions_prompt_logprobs_equal_vllm_serves() -> None:
    # "completions/prompt_logprobs" of the serve differential (prompt_logprobs=2, greedy): the
    # prompt token of each row, then the top 2; 900, 140 and 249 are partial characters, which
    # vLLM shows as "" (this layer gave "\ufffd\ufffd", "\ufffd", "\ufffd").
    ids = [[339, 621, 790], [445, 900, 479], [639, 140, 479], [797, 40, 352], [573, 74, 249],
           [282, 320, 791], [83, 320, 832], [92, 320, 777], [525, 225, 777], [515, 832, 323],
           [84, 323, 265], [87, 320, 739], [270, 323, 636], [314, 832, 320]]
    assert prompt_strings(ids) == [
        ["The", " н", " then"], [" qu", "", " are"], ["ick", "", " are"], [" br", "D", "et"],
        ["own", "f", ""], [" f", "ay", " su"], ["o", "ay", "ade"], ["x", "ay", "я"],
        [" j", " ", "я"], ["um", "ade", "ld"], ["p", "ld", " s"], ["s", "ay", " read"],
        [" o", "ld", "chen"], ["ver", "ade", "ay"]]


def test_chat_prompt_logprobs_equal_vllm_serves() -> None:
    # "chat/prompt_logprobs" of the serve differential (prompt_logprobs=1): the ChatML prompt.
    ids = [[3, 621], [476, 479], [269, 495], [203, 565], [56, 565], [509, 318], [452, 495],
           [472, 495], [264, 114], [833, 854], [4, 854], [203, 854], [3, 854], [821, 337],
           [805, 495], [469, 337], [203, 135]]
    assert prompt_strings(ids) == [
        ["<|im_start|>", " н"], ["us", " are"], ["er", ""], ["\n", " draw"], ["T", " draw"],
        ["ell", " st"], [" me", ""], [" about", ""], [" the", ""], [" sea", "“"],
        ["<|im_end|>", "“"], ["\n", "“"], ["<|im_start|>", "“"], ["ass", " wh"], ["ist", ""],
        ["ant", " wh"], ["\n", ""]]


def test_a_prompt_character_split_across_tokens_shows_in_the_row_that_completes_it() -> None:
    # "<s>Hi 中文": 中 is 375 + 260, 文 is 167 + 249 + 234. The context is the prompt tokens of
    # the rows before (the first prompt token has no row, so it is never context).
    prompt = [1, 44, 77, 225, 375, 260, 167, 249, 234]
    assert bundled_tokenizer().decode(prompt[1:]) == "Hi 中文"
    alternatives = [305, 375, 260, 542, 167, 249, 234, 375]
    assert prompt_strings([[p, a] for p, a in zip(prompt[1:], alternatives, strict=True)]) == [
        ["H", ""], ["i", ""], [" ", ""], ["", "raw"], ["中", ""], ["", ""], ["", ""],
        ["文", ""]]


def test_prompt_logprobs_without_detokenize_have_no_strings() -> None:
    got = prompt_logprob_rows(bundled_tokenizer(), rows([[375, 260], [260, 542]]),
                              detokenize=False)
    assert [[entry.token for entry in row] for row in got] == [["", ""], ["", ""]]


def test_sample_logprobs_of_a_partial_first_token_are_empty_as_in_vllm() -> None:
    # Output "中文" in two engine steps; vLLM's sampled context is the output's own tokens, so
    # the first position has none: its partial tokens show "" (this layer showed "\ufffd").
    decoder = LogprobsDecoder(bundled_tokenizer())
    first = decoder.decode(rows([[375, 305], [260, 375]]), 2)
    second = decoder.decode(rows([[167, 260], [249, 542], [234, 249]]), 3)
    assert [[entry.token for entry in row] for row in first + second] == [
        ["", ""], ["中", ""], ["", ""], ["", "raw"], ["文", "斖"]]
