"""``MockEngineConfig.greedy_continuations``: a greedy prompt that ends with tokens the mock
generated for the rest of it continues that generation, as a real model's greedy decoding
does (what request migration relies on); off by default."""

from __future__ import annotations

from anyio_genout.mock import greedy_tokens
from anyio_genout.mock.tokens import greedy_continuation, stream_key

PROMPT = [1, 2, 3]


def test_a_continuation_is_found_with_its_offset() -> None:
    generated = greedy_tokens(PROMPT, 30)
    for k in (1, 7, 29):
        found = greedy_continuation(PROMPT + generated[:k], 64, 32000)
        assert found == (stream_key(PROMPT, greedy=True), k)


def test_a_plain_prompt_is_no_continuation_and_lookback_bounds_the_search() -> None:
    generated = greedy_tokens(PROMPT, 30)
    assert greedy_continuation(PROMPT, 64, 32000) is None
    assert greedy_continuation([*PROMPT, generated[0] + 1], 64, 32000) is None
    # Longer than the lookback: not found (no shorter split continues anything).
    assert greedy_continuation(PROMPT + generated[:20], 8, 32000) is None
    assert greedy_continuation(PROMPT + generated[:20], 20, 32000) is not None


def test_corpus_mode_continues_the_corpus() -> None:
    corpus = list(range(100, 400))
    generated = greedy_tokens(PROMPT, 20, corpus=corpus)
    found = greedy_continuation(PROMPT + generated[:5], 64, 32000, corpus=corpus)
    assert found == (stream_key(PROMPT, greedy=True), 5)
