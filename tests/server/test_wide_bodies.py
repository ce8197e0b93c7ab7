"""Bodies of a few hundred thousand items (a 1 MiB body holds 260,000 one-item lists) are
answered without walking every item on the event loop.

Before, pydantic went on past a list's first bad item to make an error of every one (and a
union field did so once per list branch), and the completions route checked each of 260,000
prompts for lone surrogates and copied it before it counted them against ``max_n``: one such
request held the loop 1-4.5 s. Now the list fields stop at their first bad item and the
prompts are counted first; the answers are the same 400s, naming the same place."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import httpx
import pydantic
import pytest

from anyio_genout.errors import InvalidRequestError
from anyio_genout.protocol.validation import check_unicode
from anyio_genout.server import requests, serving
from anyio_genout.server.errors import ApiError
from anyio_genout.server.models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.server.support import served

pytestmark = pytest.mark.anyio

WIDE = 200_000

#: (model, body, the place the 400 names): a first bad item, then WIDE more bad ones.
BAD_LISTS: list[tuple[type[pydantic.BaseModel], dict[str, Any], str]] = [
    (CompletionRequest, {"prompt": [[1], "a"] * (WIDE // 2)}, "prompt"),
    (CompletionRequest, {"prompt": "a", "stop_token_ids": ["x"] * WIDE}, "stop_token_ids[0]"),
    (CompletionRequest, {"prompt": "a", "allowed_token_ids": [None] * WIDE},
     "allowed_token_ids[0]"),
    (CompletionRequest, {"prompt": "a", "bad_words": [1] * WIDE}, "bad_words[0]"),
    (ChatCompletionRequest, {"messages": [1] * WIDE}, "messages[0]"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}],
                             "documents": [1] * WIDE}, "documents[0]"),
    (TokenizeRequest, {"messages": ["x"] * WIDE}, "messages[0]"),
    (DetokenizeRequest, {"tokens": [[1]] * WIDE}, "tokens[0]"),
]


@pytest.mark.parametrize(("model", "body", "place"), BAD_LISTS,
                         ids=[place for _, _, place in BAD_LISTS])
def test_a_list_field_stops_at_its_first_bad_item(model: type[pydantic.BaseModel],
                                                  body: dict[str, Any], place: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate({"model": "m", **body})
    # One error per branch of the field's type at most, not one per item.
    assert info.value.error_count() <= 4, info.value.error_count()
    assert {error["loc"][0] for error in info.value.errors()} == {place.split("[")[0]}


async def test_wide_bad_bodies_are_400_naming_the_first_bad_item() -> None:
    routes = {CompletionRequest: "/v1/completions", ChatCompletionRequest: "/v1/chat/completions",
              TokenizeRequest: "/tokenize", DetokenizeRequest: "/detokenize"}
    async with served() as s, httpx.AsyncClient(timeout=30) as http:
        answers = [await http.post(f"{s.base_url}{routes[model]}", json=body)
                   for model, body, _ in BAD_LISTS]
        ok = await http.post(f"{s.base_url}/v1/completions",
                             json={"prompt": "Once upon a time", "max_tokens": 2})
    assert [r.status_code for r in answers] == [400] * len(BAD_LISTS)
    assert [r.json()["error"]["param"] for r in answers] == [p for _, _, p in BAD_LISTS]
    assert ok.status_code == 200  # and the server serves on


def test_too_many_prompts_are_refused_before_any_is_walked() -> None:
    body = serving.parse_body(serving.COMPLETIONS_URL, {"model": "m", "prompt": [[1]] * 260_000})
    with mock.patch.object(requests, "check_unicode", side_effect=AssertionError("walked")), \
            mock.patch.object(requests, "_prompts", side_effect=AssertionError("walked")), \
            pytest.raises(ApiError) as info:
        serving.choices(body, max_n=16, max_model_len=None)
    assert info.value.param == "prompt"
    assert "260000 prompts with n=1 are 260000 choices; at most 16" in str(info.value)


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]]], ids=["texts", "token-id-lists"])
def test_several_prompts_are_counted_as_the_choices_they_make(prompt: Any) -> None:
    body = serving.parse_body(serving.COMPLETIONS_URL, {"model": "m", "prompt": prompt, "n": 8})
    assert len(serving.choices(body, max_n=16, max_model_len=None).requests) == 16
    with pytest.raises(ApiError, match="2 prompts with n=8 are 16 choices; at most 15"):
        serving.choices(body, max_n=15, max_model_len=None)


@pytest.mark.parametrize("prompt", ["abc", [1, 2, 3]], ids=["text", "token-ids"])
def test_one_prompt_makes_n_choices(prompt: Any) -> None:
    body = serving.parse_body(serving.COMPLETIONS_URL, {"model": "m", "prompt": prompt, "n": 16})
    made = serving.choices(body, max_n=16, max_model_len=None).requests
    assert len(made) == 16
    assert {(r.prompt, r.prompt_token_ids and tuple(r.prompt_token_ids)) for r in made} == {
        ("abc", None) if prompt == "abc" else (None, (1, 2, 3))}


def test_lone_surrogates_are_still_found_among_plain_values() -> None:
    value = json.loads('[1, null, 2.5, true, "ok", {"a": [3, "x\\udc00"]}]')
    with pytest.raises(InvalidRequestError) as info:
        check_unicode(value, "messages")
    assert info.value.field == "messages[5].a[1]"
    with pytest.raises(InvalidRequestError) as info:
        check_unicode(json.loads('{"k": "\\ud800"}'), "chat_template_kwargs")
    assert info.value.field == "chat_template_kwargs.k"
