"""``bad_words`` and ``truncate_prompt_tokens``: what reaches the engine is what vLLM 0.32
makes of them (its ``update_from_tokenizer`` and its renderer's truncation), checked on the
ADD the mock engine receives."""

from __future__ import annotations

import pytest

from anyio_genout.errors import InvalidRequestError
from anyio_genout.protocol import SamplingParams
from anyio_genout.text.request import TextRequest
from tests.text.client_support import added, text_client, tokenizer

pytestmark = pytest.mark.anyio

LONG = "The keeper wrote the weather in the ledger every evening. " * 2000  # > the bound


async def _sent(**fields: object) -> tuple[list[int], object]:
    """The prompt ids and ``bad_words_token_ids`` the engine got for one request."""
    async with text_client(keep_history=True) as setup:
        request = TextRequest(sampling_params=SamplingParams(max_tokens=2), **fields)  # type: ignore[arg-type]
        async with setup.text.generate(request) as stream:
            async for _ in stream:
                pass
        [add] = added(setup.engine)
    return list(add.request.prompt_token_ids), add.request.sampling_params.bad_words_token_ids


def _expected_bad_words(words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM 0.32's rule, written out: the word, and the word after a space when that is a
    different first token and as many tokens."""
    tok = tokenizer()
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tok.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tok.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


async def test_bad_words_reach_the_engine_as_vllms_token_sequences() -> None:
    words = ["river", "  ledger", "weather keeper"]
    _, bad = await _sent(prompt="Once upon a time", bad_words=words)
    assert bad == _expected_bad_words(words)
    assert bad and all(bad)  # (this WordPiece tokenizer ignores the space: one each)


@pytest.mark.parametrize(("words", "field", "words_in_message"), [
    ([""], "bad_words", "cannot contain an empty string"),
    (["  "], "bad_words", "must tokenize to at least one token"),
    (["ok", 3], "bad_words[1]", "must be a string"),
    ([f"river{i}" for i in range(129)], "bad_words",
     "Too many bad words after tokenization: 129"),
])
async def test_hostile_bad_words_are_refused_naming_the_field(
        words: list[object], field: str, words_in_message: str) -> None:
    async with text_client() as setup:
        with pytest.raises(InvalidRequestError) as caught:
            async with setup.text.generate(TextRequest(prompt="Hi", bad_words=words)):  # type: ignore[arg-type]
                pass
    assert caught.value.field == field
    assert words_in_message in str(caught.value)


async def test_a_truncated_text_prompt_keeps_the_bos_and_the_last_tokens_by_default() -> None:
    tok = tokenizer()
    full = tok.encode(LONG)
    head = len(tok.encode("", add_special_tokens=True))
    sent, _ = await _sent(prompt=LONG, truncate_prompt_tokens=10)  # not refused for its length
    assert len(sent) == 10
    assert sent[:head] == full[:head] and sent[head:] == full[-(10 - head):]


@pytest.mark.parametrize("side", ["left", "right"])
async def test_truncation_side_keeps_that_end(side: str) -> None:
    ids = list(range(5, 105))
    sent, _ = await _sent(prompt_token_ids=ids, truncate_prompt_tokens=7, truncation_side=side)
    assert sent == (ids[-7:] if side == "left" else ids[:7])
    text = "one two three four five six seven eight nine ten " * 3
    full = tokenizer().encode(text)
    sent, _ = await _sent(prompt=text, truncate_prompt_tokens=4, truncation_side=side)
    assert sent == (full[-4:] if side == "left" else full[:4])


async def test_minus_one_keeps_the_context_less_one_token() -> None:
    sent, _ = await _sent(prompt_token_ids=list(range(1, 4200)), truncate_prompt_tokens=-1)
    assert sent == list(range(1, 4200))[-4095:]


@pytest.mark.parametrize(("fields", "field", "words_in_message"), [
    ({"truncate_prompt_tokens": 5000}, "truncate_prompt_tokens",
     "truncate_prompt_tokens=5000 cannot be greater than max_total_tokens = 4096"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "must be an integer >= -1"),
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens", "must be an integer >= -1"),
    ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side",
     "must be either 'left' or 'right'"),
])
async def test_hostile_truncation_is_refused_naming_the_field(
        fields: dict[str, object], field: str, words_in_message: str) -> None:
    async with text_client() as setup:
        with pytest.raises(InvalidRequestError) as caught:
            async with setup.text.generate(TextRequest(prompt="Hi", **fields)):  # type: ignore[arg-type]
                pass
    assert caught.value.field == field
    assert words_in_message in str(caught.value)
