"""Differential test of ``bad_words`` against vLLM 0.32 itself: the token sequences our text
layer sends (:func:`anyio_genout.text.bad_words.bad_words_token_ids`) equal what vLLM's
``SamplingParams.update_from_tokenizer`` makes, with vLLM's own tokenizer of the same folder,
for hypothesis-generated words (leading spaces, several words, accents, CJK, emoji) on both
tokenizer kinds of tests/text/tokenizer_kinds.py; a word vLLM refuses we refuse too. Needs
vLLM importable (the interop venv); no engine."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyio_genout.errors import InvalidRequestError
from anyio_genout.text.bad_words import bad_words_token_ids
from anyio_genout.text.tokenizer import Tokenizer
from tests.protocol._hyp import SCALE
from tests.text.tokenizer_kinds import KINDS, kind_dir

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's and torch's import-time deprecation noise
    pytest.importorskip("vllm", reason="needs vLLM (the interop venv)")
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.tokenizers import get_tokenizer

CASES = max(1, int(300 * SCALE))

_WORD = st.text(st.sampled_from("abcdeéü 日本🙂xyz"), min_size=0, max_size=8)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_words_equal_vllms(kind: str) -> None:
    folder = kind_dir(kind)
    ours = Tokenizer.from_model_dir(folder)
    theirs = get_tokenizer(str(folder))

    @settings(max_examples=CASES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(_WORD, min_size=1, max_size=4))
    def check(words: list[str]) -> None:
        try:
            params = SamplingParams(bad_words=words)
            params.update_from_tokenizer(theirs)
        except VLLMValidationError as exc:
            with pytest.raises(InvalidRequestError) as caught:
                bad_words_token_ids(ours, words)
            assert caught.value.field == "bad_words"
            message = str(exc).split(" Got bad_words=")[0].split(" (parameter=")[0]
            assert message in str(caught.value)
            return
        expected = tuple(tuple(ids) for ids in params._bad_words_token_ids or [])
        assert bad_words_token_ids(ours, words) == expected

    check()
