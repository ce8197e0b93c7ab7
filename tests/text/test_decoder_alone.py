"""The text layer alone (issue 25 item 5): a caller that drives the token layer itself and
decodes with :class:`TextDecoder` built from the project's :class:`Tokenizer` gets the text
and the finish reason a :class:`TextStream` gives, on a mock engine that replays a script
(corpus mode from position 0, then EOS: docs/api.md, "Replaying a recorded output")."""

from __future__ import annotations

import pytest

from anyio_genout import FinishReason, GenerateRequest, SamplingParams
from anyio_genout.text import TextDecoder, TextRequest
from tests.text.client_support import TextSetup, text_client, tokenizer

pytestmark = pytest.mark.anyio

EOS = 2  # the bundled tokenizer's </s>
SCRIPT = "Hello there. The weather is fine, 22 °C! Bye."


def script_ids() -> list[int]:
    ids = tokenizer().encode(SCRIPT, add_special_tokens=False)
    assert tokenizer().decode(ids) == SCRIPT
    return ids


def replaying() -> dict[str, object]:
    """The mock options that replay the script to every request, as documented."""
    return {"corpus_token_ids": (*script_ids(), EOS), "corpus_starts": (0,),
            "eos_token_id": EOS, "eos_probability": 0.0}


async def through_text_stream(setup: TextSetup, stop: tuple[str, ...],
                              max_tokens: int) -> tuple[str, FinishReason | None]:
    request = TextRequest(prompt="Weather?", stop=stop,
                          sampling_params=SamplingParams(temperature=0.0,
                                                         max_tokens=max_tokens))
    async with setup.text.generate(request) as stream:
        outputs = [out async for out in stream]
    return "".join(o.text for o in outputs), outputs[-1].finish_reason


async def through_the_token_layer(setup: TextSetup, stop: tuple[str, ...],
                                  max_tokens: int) -> tuple[str, FinishReason | None]:
    prompt = tokenizer().encode("Weather?")
    decoder = TextDecoder(tokenizer(), prompt, stop=stop)
    request = GenerateRequest(request_id="alone", prompt_token_ids=prompt,
                              sampling_params=SamplingParams(
                                  temperature=0.0, max_tokens=max_tokens, eos_token_id=EOS))
    text = ""
    finish = None
    async with setup.client.generate(request) as stream:
        async for out in stream:
            step = decoder.update(out.token_ids, out.finish_reason)
            text += step.text
            if step.finished:  # leaving the block now frees a request a stop string ended
                finish = step.finish_reason
                break
    assert decoder.finished and decoder.text == text
    return text, finish


@pytest.mark.parametrize(("stop", "max_tokens", "text", "finish"), [
    ((), 200, SCRIPT, FinishReason.stop_eos()),
    (("fine",), 200, "Hello there. The weather is ", FinishReason.stop("fine")),
    (("°C", "Bye"), 200, "Hello there. The weather is fine, 22 ", FinishReason.stop("°C")),
    ((), 4, None, FinishReason.LENGTH),
], ids=["eos", "stop-string", "two-stops", "length"])
async def test_the_decoder_alone_gives_the_text_and_finish_of_a_text_stream(
        stop: tuple[str, ...], max_tokens: int, text: str | None,
        finish: FinishReason) -> None:
    async with text_client(**replaying()) as setup:
        streamed = await through_text_stream(setup, stop, max_tokens)
        alone = await through_the_token_layer(setup, stop, max_tokens)
    expected = tokenizer().decode(script_ids()[:max_tokens]) if text is None else text
    assert streamed == alone == (expected, finish)
    assert finish.as_str() in ("stop", "length")


async def test_the_replaying_mock_emits_the_script_one_token_per_step_then_eos() -> None:
    async with text_client(**replaying()) as setup:
        for prompt in ([5, 6, 7], [300, 9]):  # any prompt, greedy or sampled, same script
            for temperature in (0.0, 1.0):
                request = GenerateRequest(
                    request_id="replay", prompt_token_ids=prompt, sampling_params=SamplingParams(
                        temperature=temperature, max_tokens=500, eos_token_id=EOS))
                async with setup.client.generate(request, per_step=True) as stream:
                    outputs = [out async for out in stream]
                assert [o.token_ids for o in outputs] == [[t] for t in (*script_ids(), EOS)]
                assert outputs[-1].finish_reason == FinishReason.stop_eos()
