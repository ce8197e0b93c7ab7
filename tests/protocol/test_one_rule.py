"""One place per decision: the output-token cap (vLLM's rule), text a tokenizer takes and
token ids in the vocabulary, each checked by one function with one wording."""

from __future__ import annotations

import pytest

from anyio_genout import InvalidRequestError
from anyio_genout.protocol import EngineCoreRequest, SamplingParams
from anyio_genout.protocol.validation import (
    DEFAULT_MAX_TOKENS,
    check_text,
    check_token_ids,
    check_unicode,
    resolve_max_tokens,
)


@pytest.mark.parametrize(("max_tokens", "prompt_len", "expected"), [
    (None, 10, 54),  # None: the rest of the context
    (20, 10, 20),
    (60, 10, 54),  # a prompt plus max_tokens beyond the context: cut to the room left
    (64, 10, 54),  # exactly the context: allowed (vLLM refuses only above it)
    (1, 63, 1),
])
def test_the_cap_is_vllms(max_tokens: int | None, prompt_len: int, expected: int) -> None:
    assert resolve_max_tokens(max_tokens, prompt_len, 64) == expected


def test_without_a_context_the_engines_default_applies() -> None:
    assert resolve_max_tokens(None, 10, None) == DEFAULT_MAX_TOKENS
    assert resolve_max_tokens(500, 10, None) == 500


def test_above_the_context_is_refused_in_vllms_words() -> None:
    with pytest.raises(InvalidRequestError) as info:
        resolve_max_tokens(65, 3, 64)
    assert info.value.field == "max_tokens"
    assert info.value.message == ("max_tokens=65 cannot be greater than max_model_len=64. "
                                  "Please request fewer output tokens.")


@pytest.mark.parametrize(("max_tokens", "field"), [
    (None, "prompt_token_ids"), (0, "max_tokens"), (True, "max_tokens"), (2**70, "max_tokens"),
])
def test_a_full_prompt_or_a_bad_cap_is_refused_by_name(max_tokens: object, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        resolve_max_tokens(max_tokens, 64 if max_tokens is None else 3, 64)  # type: ignore[arg-type]
    assert info.value.field == field


def test_the_request_resolves_with_the_same_rule() -> None:
    params = SamplingParams(max_tokens=60)
    request = EngineCoreRequest(request_id="r", prompt_token_ids=list(range(10)),
                                sampling_params=params, arrival_time=0.0)
    assert request.resolved_max_tokens(64) == 54
    with pytest.raises(InvalidRequestError, match="max_tokens=60 cannot be greater than "
                                                  "max_model_len=32"):
        request.validate(max_model_len=32)
    with pytest.raises(InvalidRequestError, match=r"at most the request's max_tokens \(4\)"):
        EngineCoreRequest(request_id="r", prompt_token_ids=list(range(60)),
                          sampling_params=SamplingParams(min_tokens=5),
                          arrival_time=0.0).validate(max_model_len=64)


def test_one_wording_for_a_lone_surrogate() -> None:
    with pytest.raises(InvalidRequestError) as text:
        check_text("ab\ud800", "prompt")
    with pytest.raises(InvalidRequestError) as nested:
        check_unicode([{"role": "user", "content": "ab\ud800"}], "messages")
    assert str(text.value) == ("invalid request: prompt: is not valid Unicode text: lone "
                               "surrogate at index 2")
    assert nested.value.field == "messages[0].content"
    assert nested.value.message == text.value.message
    check_unicode({"a": ["é", 3, None]}, "chat_template_kwargs")  # valid text passes


def test_one_wording_for_a_token_outside_the_vocabulary() -> None:
    for bad in (1000, -1):
        with pytest.raises(InvalidRequestError) as info:
            check_token_ids([1, bad], "tokens", 1000)
        assert str(info.value) == (f"invalid request: tokens[1]: {bad} is not in the "
                                   "vocabulary (0..999)")
    with pytest.raises(InvalidRequestError) as prompt:
        EngineCoreRequest(request_id="r", prompt_token_ids=[5, 1000],
                          sampling_params=SamplingParams(), arrival_time=0.0
                          ).validate(vocab_size=1000)
    assert str(prompt.value) == ("invalid request: prompt_token_ids[1]: 1000 is not in the "
                                 "vocabulary (0..999)")
