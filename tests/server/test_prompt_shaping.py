"""``truncate_prompt_tokens``, ``truncation_side`` and ``bad_words`` through real HTTP on every
backend, on both routes: the prompt the engine gets is what vLLM 0.32 keeps (seen in
``usage``, the prompt's logprobs and the answer), a bad word of the plain greedy answer is
not in the answer that bans it, and bad values are refused with a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.support import MODEL, Served, served
from tests.text.client_support import PROMPT, added, tokenizer

pytestmark = pytest.mark.anyio

LONG = "The quick brown fox jumps over the lazy dog and runs far away"
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": LONG}]


async def _post(s: Served, path: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=s.v1, timeout=10) as http:
        return await http.post(path, json={"model": MODEL, "temperature": 0.0, **body})


async def _completion(s: Served, **body: Any) -> dict[str, Any]:
    answer = await _post(s, "/completions", **{"prompt": LONG, "max_tokens": 6, **body})
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


async def _tokens(s: Served, prompt: str) -> list[int]:
    async with httpx.AsyncClient(base_url=s.base_url, timeout=10) as http:
        ids: list[int] = (await http.post("/tokenize", json={"prompt": prompt})).json()["tokens"]
    return ids


def _refused(answer: httpx.Response, field: str) -> str:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field
    return str(error["message"])


def _prompt_shown(result: dict[str, Any]) -> list[int]:
    """The prompt token ids the response's ``prompt_logprobs`` show (the first has none)."""
    rows = result["choices"][0]["prompt_logprobs"]
    assert rows[0] is None
    return [int(next(iter(row))) for row in rows[1:]]


async def test_truncate_prompt_tokens_keeps_that_many_on_the_side_asked() -> None:
    async with served(max_model_len=64) as s:
        ids = await _tokens(s, LONG)
        assert len(ids) > 10 and ids[0] == 1  # the BOS, then the text's tokens
        kept = {
            # vLLM's default for a generating model: the BOS stays, the text is cut on the left
            None: [ids[0], *ids[-4:]], "left": ids[-5:], "right": ids[:5]}
        for side, expected in kept.items():
            result = await _completion(s, truncate_prompt_tokens=5, truncation_side=side,
                                       prompt_logprobs=0)
            assert result["usage"]["prompt_tokens"] == 5
            assert _prompt_shown(result) == expected[1:]
            # The answer is the one the kept tokens give as the prompt.
            same = await _completion(s, prompt=expected)
            assert result["choices"][0]["text"] == same["choices"][0]["text"]
        assert kept["left"] != kept["right"]
        whole = await _completion(s, truncate_prompt_tokens=64)  # max_model_len
        assert whole["usage"]["prompt_tokens"] == len(ids)  # a shorter prompt is kept whole


async def test_truncate_prompt_tokens_minus_one_is_the_context_less_one() -> None:
    async with served(max_model_len=64) as s:
        too_long = await _post(s, "/completions", prompt=[5] * 100, max_tokens=1)
        cut = await _completion(s, prompt=[*range(10, 110)], max_tokens=1,
                                truncate_prompt_tokens=-1, prompt_logprobs=0)
        chat = await _post(s, "/chat/completions", messages=[
            {"role": "user", "content": LONG * 20}], max_tokens=1, truncate_prompt_tokens=-1)
    assert "max_model_len=64" in _refused(too_long, "input_tokens")
    assert cut["usage"]["prompt_tokens"] == 63
    assert _prompt_shown(cut) == [*range(48, 110)]  # the last 63 ids, the first shown none
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == 63


async def test_chat_truncation_counts_the_rendered_prompt() -> None:
    async with served() as s:
        left = await _post(s, "/chat/completions", messages=MESSAGES, max_tokens=4,
                           truncate_prompt_tokens=7, truncation_side="left")
        left_ids = list(added(s.setup.engine)[-1].request.prompt_token_ids)
        right = await _post(s, "/chat/completions", messages=MESSAGES, max_tokens=4,
                            truncate_prompt_tokens=7, truncation_side="right")
        right_ids = list(added(s.setup.engine)[-1].request.prompt_token_ids)
        whole = await _post(s, "/chat/completions", messages=MESSAGES, max_tokens=4)
        whole_ids = list(added(s.setup.engine)[-1].request.prompt_token_ids)
    for answer in (left, right):
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] == 7
    assert whole.json()["usage"]["prompt_tokens"] == len(whole_ids) > 7
    assert left_ids == whole_ids[-7:] and right_ids == whole_ids[:7]


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens",
     "truncate_prompt_tokens=65 cannot be greater than max_total_tokens = 64"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "greater than or equal to -1"),
    ({"truncate_prompt_tokens": 5, "truncation_side": "middle"}, "truncation_side", "'left'"),
    ({"bad_words": [""]}, "bad_words", "bad_words cannot contain an empty string"),
    ({"bad_words": ["ok", ""]}, "bad_words", "bad_words cannot contain an empty string"),
    ({"bad_words": "postman"}, "bad_words", "valid list"),
])
@pytest.mark.parametrize("chat", [False, True])
async def test_bad_values_are_refused_naming_the_field(body: dict[str, Any], field: str,
                                                       words: str, chat: bool) -> None:
    async with served(max_model_len=64) as s:
        answer = await (_post(s, "/chat/completions", messages=MESSAGES, max_tokens=2, **body)
                        if chat else _post(s, "/completions", prompt=PROMPT, max_tokens=2,
                                           **body))
        assert words in _refused(answer, field)
        assert not added(s.setup.engine)  # nothing reached the engine


async def test_a_bad_word_of_the_greedy_answer_is_not_generated() -> None:
    async with served() as s:
        plain = await _completion(s, prompt=PROMPT, max_tokens=40)
        text = plain["choices"][0]["text"]
        assert " postman " in text and " road " in text  # the corpus's greedy continuation
        banned = await _completion(s, prompt=PROMPT, max_tokens=40, bad_words=["postman"])
        both = await _completion(s, prompt=PROMPT, max_tokens=40,
                                 bad_words=["postman", "road"])
        async with httpx.AsyncClient(base_url=s.v1, timeout=10) as http:
            streamed = await http.post("/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0,
                "bad_words": ["postman"], "stream": True})
    banned_text = banned["choices"][0]["text"]
    assert "postman" not in banned_text
    # Only the word's last token is redrawn: the text up to it is the plain answer's.
    assert banned_text.startswith(text[:text.index(" postman ") + 5])
    assert "postman" not in both["choices"][0]["text"]
    assert " road " not in both["choices"][0]["text"]
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == banned_text


async def test_chat_bad_words_are_banned_in_the_answer() -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    async with served() as s:
        plain = await _post(s, "/chat/completions", messages=messages, max_tokens=40)
        text = plain.json()["choices"][0]["message"]["content"]
        # A word vLLM's rule bans in the middle of a text too (its spaced form is as many
        # tokens as it; "anyone" is not: " anyone" encodes otherwise and stays allowed).
        word = next(w for w in text.split() if len(w) > 4 and w.isalpha() and len(
            tokenizer().encode(" " + w, add_special_tokens=False)) == len(
            tokenizer().encode(w, add_special_tokens=False)))
        banned = await _post(s, "/chat/completions", messages=messages, max_tokens=40,
                             bad_words=[word])
        sent = added(s.setup.engine)[-1].request.sampling_params.bad_words_token_ids
    assert banned.status_code == 200, banned.text
    assert sent  # the word's token sequences reached the engine
    assert word not in banned.json()["choices"][0]["message"]["content"]
