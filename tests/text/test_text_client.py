"""The text client over a real mock engine: what it sends (prompt encoding, chat template,
the model's EOS ids), what it refuses before sending, logprobs with token strings, and the
collected result."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from anyio_genout import FinishReason, InvalidRequestError, SamplingParams, TokenUsage
from anyio_genout.text.request import TextRequest
from anyio_genout.text.stream import TextStream

from .client_support import PROMPT, added, predicted, text_client, tokenizer

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about the lighthouse."}]


def greedy(max_tokens: int = 8, **params: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)


async def test_a_prompt_is_encoded_with_bos_and_the_model_eos_ids_are_filled_in() -> None:
    async with text_client() as setup:
        request = TextRequest(request_id="p", prompt=PROMPT,
                              sampling_params=greedy(stop_token_ids=[7]))
        async with setup.text.generate(request) as stream:
            await stream.collect_text()
        [add] = added(setup.engine)
        ids = list(add.request.prompt_token_ids)
        assert ids == tokenizer().encode(PROMPT) and ids[0] == tokenizer().bos_token_id
        assert stream.prompt_token_ids == tuple(ids) and stream.prompt == PROMPT
        # As vLLM's update_from_generation_config: the primary EOS (</s>) stops the request;
        # the folder's other EOS id (<|im_end|>) joins the stop token ids.
        assert add.sampling_wire["_eos_token_id"] == tokenizer().eos_token_id == 2
        assert sorted(add.sampling_wire["stop_token_ids"]) == [4, 7]
        assert add.request.external_req_id == "p"


async def test_ignore_eos_and_an_explicit_eos_are_left_alone() -> None:
    async with text_client() as setup:
        for request_id, params in (("ignore", greedy(ignore_eos=True)),
                                   ("own", greedy(eos_token_id=9))):
            request = TextRequest(request_id=request_id, prompt=PROMPT, sampling_params=params)
            async with setup.text.generate(request) as stream:
                await stream.collect_text()
        ignore, own = (add.sampling_wire for add in added(setup.engine))
        assert "_eos_token_id" not in ignore and ignore["stop_token_ids"] == []
        assert own["_eos_token_id"] == 9 and own["stop_token_ids"] == [4]


async def test_messages_go_through_the_chat_template_without_a_second_bos() -> None:
    rendered = tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert rendered.startswith("<s><|im_start|>system\n")
    async with text_client() as setup:
        request = TextRequest(messages=MESSAGES, sampling_params=greedy(16))
        async with setup.text.generate(request) as stream:
            result = await stream.collect_text()
        [add] = added(setup.engine)
        ids = list(add.request.prompt_token_ids)
        assert ids == tokenizer().encode(rendered, add_special_tokens=False)
        assert ids.count(1) == 1 and tokenizer().bos_token_id == 1
        assert result.prompt == rendered and result.prompt_token_ids == tuple(ids)
        assert result.text == tokenizer().decode(predicted(ids, 16))


async def test_prompt_token_ids_are_sent_as_they_are() -> None:
    async with text_client() as setup:
        request = TextRequest(prompt_token_ids=[5, 6, 7], sampling_params=greedy(12))
        async with setup.text.generate(request) as stream:
            result = await stream.collect_text()
        assert list(added(setup.engine)[0].request.prompt_token_ids) == [5, 6, 7]
        assert result.prompt is None and result.prompt_token_ids == (5, 6, 7)
        assert result.token_ids == predicted([5, 6, 7], 12)
        assert result.text == tokenizer().decode(result.token_ids)


async def test_collect_text_gathers_the_whole_generation() -> None:
    async with text_client() as setup:
        request = TextRequest(request_id="whole", prompt=PROMPT, sampling_params=greedy(20))
        async with setup.text.generate(request) as stream:
            result = await stream.collect_text()
        ids = tokenizer().encode(PROMPT)
        assert result.request_id == stream.request_id and result.request_id.startswith("whole-")
        assert result.token_ids == predicted(ids, 20)
        assert result.text == tokenizer().decode(result.token_ids)
        assert result.finish_reason == FinishReason.LENGTH
        assert result.usage == TokenUsage(len(ids), 20, 0)
        assert result.logprobs is None


async def test_logprobs_carry_token_strings_and_are_cut_with_the_text() -> None:
    ids = predicted(tokenizer().encode(PROMPT), 40)
    full = tokenizer().decode(ids)
    stop = full[len(tokenizer().decode(ids[:10])):][:5]
    async with text_client(step_time=0.002) as setup:
        request = TextRequest(prompt=PROMPT, sampling_params=greedy(1000, logprobs=2),
                              stop=stop)
        async with setup.text.generate(request) as stream:
            result = await stream.collect_text()
    assert result.finish_reason == FinishReason.stop(stop)
    assert result.logprobs is not None
    assert len(result.logprobs) == len(result.token_ids) < 40  # one per kept token
    for token, position in zip(result.token_ids, result.logprobs, strict=True):
        assert len(position) == 3  # the sampled token, then the 2 most likely
        assert position[0].token_id == token and position[0].rank == 1  # greedy
        assert [entry.rank for entry in position[1:]] == [1, 2]
        assert [entry.token for entry in position] == tokenizer().token_strings(
            [entry.token_id for entry in position])
    assert "".join(p[0].token for p in result.logprobs).startswith(result.text)


async def test_detokenize_false_gives_tokens_without_text() -> None:
    async with text_client() as setup:
        request = TextRequest(prompt=PROMPT, sampling_params=greedy(10, logprobs=1),
                              detokenize=False)
        async with setup.text.generate(request) as stream:
            result = await stream.collect_text()
    assert result.text == "" and result.token_ids == predicted(tokenizer().encode(PROMPT), 10)
    assert result.logprobs is not None and {e.token for p in result.logprobs for e in p} == {""}


@pytest.mark.parametrize(("fields", "field"), [
    ({"prompt": PROMPT, "stop": [""]}, "stop[0]"),
    ({"prompt": PROMPT, "stop": 123}, "stop"),
    ({"prompt": PROMPT, "stop": ["ok", 5]}, "stop[1]"),
    ({"prompt": PROMPT, "messages": MESSAGES}, "messages"),
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "", "add_special_tokens": False}, "prompt"),  # no tokens at all
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": ["hello"]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"prompt": PROMPT, "stop": ["x"], "detokenize": False}, "stop"),
    ({"prompt": PROMPT, "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"prompt": PROMPT, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs"),
    ({"prompt": PROMPT, "sampling_params": {"max_tokens": 3}}, "sampling_params"),
    ({"prompt_token_ids": [1, 32000]}, "prompt_token_ids[1]"),
    ({"prompt_token_ids": 5}, "prompt_token_ids"),
    ({"prompt": "a\ud800"}, "prompt"),  # a lone surrogate (JSON's "\ud800" gives one)
    ({"messages": [{"role": "user", "content": "\udc00"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text"),
    ({"prompt": PROMPT, "stop": ["ok", "\ud800"]}, "stop[1]"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, "2"]}, "prompt_token_ids[1]"),
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt": PROMPT, "sampling_params": SamplingParams(min_tokens=-1)}, "min_tokens"),
])
async def test_a_bad_request_is_refused_naming_the_field_with_nothing_sent(
        fields: dict[str, Any], field: str) -> None:
    async with text_client() as setup:
        with pytest.raises(InvalidRequestError) as caught:
            async with setup.text.generate(TextRequest(**fields)):
                pytest.fail("entered")  # pragma: no cover
        assert caught.value.field == field, caught.value
        await anyio.sleep(0.02)
        assert added(setup.engine) == [] and setup.client.engine.in_flight == 0
        assert len(setup.client.inflight) == 0


async def test_a_tokenizer_larger_than_the_clients_vocabulary_is_refused() -> None:
    from anyio_genout.text.client import TextClient
    from tests.cluster import generate_client

    async with generate_client(vocab_size=512, mock={"vocab_size": 512}) as (client, _):
        with pytest.raises(ValueError, match=r"1024 tokens.*vocab_size=512"):
            TextClient(client, tokenizer())


async def test_a_stream_has_no_public_constructor() -> None:
    with pytest.raises(TypeError, match="no public constructor"):
        TextStream(None, None, None, None)  # type: ignore[arg-type]
    async with text_client() as setup:
        stream = setup.text.generate(TextRequest(prompt=PROMPT, sampling_params=greedy()))
        with pytest.raises(RuntimeError, match="async with"):
            await stream.__anext__()
        async with stream:
            await stream.collect_text()
        with pytest.raises(RuntimeError, match="only once"):
            await stream.__aenter__()
