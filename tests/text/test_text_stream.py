"""The text stream over a real mock engine: text deltas, stop strings and their ABORT, the
scope rules of the token stream underneath (leaving early, one reader, async generators)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

import anyio
import pytest

from anyio_genout import EngineDeadError, FinishReason, SamplingParams
from anyio_genout.text.client import TextClient
from anyio_genout.text.output import TextOutput, merge_outputs
from anyio_genout.text.request import TextRequest
from tests.support import wait_until

from .client_support import PROMPT, predicted, success_total, text_client, tokenizer

pytestmark = pytest.mark.anyio


def greedy(max_tokens: int, **params: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)  # type: ignore[arg-type]


def prompt_ids(prompt: str = PROMPT) -> list[int]:
    return tokenizer().encode(prompt)


def decoded(ids: list[int]) -> str:
    return tokenizer().decode(ids)


def tokens_to_complete(ids: list[int], end: int) -> int:
    """How many of ``ids`` it takes for their text to reach ``end`` characters."""
    return next(n for n in range(1, len(ids) + 1) if len(decoded(ids[:n])) >= end)


def mid_stream_stop(count: int = 60, at: int = 12, length: int = 6) -> tuple[str, int, str]:
    """(full text of ``count`` predicted tokens, index of a stop string's first occurrence
    about ``at`` tokens in, the stop string)."""
    ids = predicted(prompt_ids(), count)
    full = decoded(ids)
    start = len(decoded(ids[:at]))
    while full.find(full[start:start + length]) != start or not full[start:start + length]:
        start += 1
    return full, start, full[start:start + length]


async def test_streamed_text_is_the_decoded_token_ids() -> None:
    async with text_client() as setup:
        ids = prompt_ids()
        async with setup.text.generate(TextRequest(prompt=PROMPT,
                                                   sampling_params=greedy(64))) as stream:
            outs = [out async for out in stream]
        tokens = [t for out in outs for t in out.token_ids]
        assert tokens == predicted(ids, 64)
        text = "".join(out.text for out in outs)
        assert text == decoded(tokens) and len(text) > 100
        assert outs[0].prompt_token_ids == tuple(ids) and outs[0].prompt == PROMPT
        assert all(out.prompt_token_ids is None and out.prompt is None for out in outs[1:])
        # Steps that waited for the consumer come merged: the finish is the last output's.
        assert [out.finish_reason for out in outs] == [None] * (len(outs) - 1) + [
            FinishReason.LENGTH]
        assert success_total(setup.client) == {"length": 1.0}


@pytest.mark.parametrize("per_step", [True, False], ids=["per-step", "coalesced"])
async def test_multi_byte_characters_never_show_half_decoded(per_step: bool) -> None:
    # A prompt whose greedy continuation runs through text in other scripts.
    prompt = next(p for p in (f"Story {i}:" for i in range(500))
                  if any(ord(c) > 0x2000 for c in decoded(predicted(prompt_ids(p), 40))))
    async with text_client() as setup:
        request = TextRequest(prompt=prompt, sampling_params=greedy(40))
        async with setup.text.generate(request, per_step=per_step) as stream:
            outs = [out async for out in stream]
    deltas = [out.text for out in outs]
    assert "".join(deltas) == decoded(predicted(prompt_ids(prompt), 40))
    assert not any("\ufffd" in delta for delta in deltas)
    if per_step:  # one token a step: some token completed no character by itself
        assert len(outs) == 40
        assert "" in deltas[:-1]  # held, not mangled


def cut_inside_a_character() -> tuple[str, int]:
    """(a prompt, a max_tokens) whose greedy continuation ends inside a character."""
    for prompt in (f"Story {i}:" for i in range(500)):
        ids = predicted(prompt_ids(prompt), 40)
        for count in range(8, 40):
            if decoded(ids[:count]).endswith("\ufffd"):
                return prompt, count
    raise AssertionError("no continuation ends inside a character")


@pytest.mark.parametrize("per_step", [True, False], ids=["per-step", "coalesced"])
async def test_a_character_cut_by_max_tokens_is_not_shown_as_vllm_shows_none(
        per_step: bool) -> None:
    prompt, count = cut_inside_a_character()
    ids = predicted(prompt_ids(prompt), count)
    clean = max(n for n in range(count) if not decoded(ids[:n]).endswith("\ufffd"))
    async with text_client() as setup:
        request = TextRequest(prompt=prompt, sampling_params=greedy(count))
        async with setup.text.generate(request, per_step=per_step) as stream:
            outs = [out async for out in stream]
        async with setup.text.generate(request) as stream:
            whole = await stream.collect_text()
    deltas = [out.text for out in outs]
    # vLLM's text: up to the last token whose text ended cleanly, no trailing U+FFFD.
    assert "".join(deltas) == whole.text == decoded(ids[:clean])
    assert not any("\ufffd" in delta for delta in deltas)
    assert [t for out in outs for t in out.token_ids] == list(whole.token_ids) == ids
    assert outs[-1].finish_reason == whole.finish_reason == FinishReason.LENGTH


async def test_a_stop_string_mid_stream_truncates_and_aborts_once_counted_as_stop() -> None:
    full, start, stop = mid_stream_stop()
    ids = predicted(prompt_ids(), 60)
    async with text_client(step_time=0.002) as setup:
        request = TextRequest(prompt=PROMPT, sampling_params=greedy(1000), stop=[stop, "@@@"])
        async with setup.text.generate(request) as stream:
            outs = [out async for out in stream]
            internal = stream.request_id
            # The engine is told while the scope is still open.
            await wait_until(lambda: setup.engine.aborted_ids == [internal])
        assert "".join(out.text for out in outs) == full[:start]
        assert outs[-1].finish_reason == FinishReason.stop(stop)
        assert [out.finished for out in outs].count(True) == 1
        kept = [t for out in outs for t in out.token_ids]
        assert kept == ids[:tokens_to_complete(ids, start + len(stop))]
        await anyio.sleep(0.05)
        assert setup.engine.aborted_ids == [internal]  # one ABORT, none more on scope exit
        assert setup.engine.abort_frames == 1
        assert success_total(setup.client) == {"stop": 1.0}  # not counted as an abort
        assert setup.client.engine.in_flight == 0


async def test_include_stop_str_in_output_keeps_the_match() -> None:
    full, start, stop = mid_stream_stop()
    async with text_client(step_time=0.002) as setup:
        request = TextRequest(prompt=PROMPT, sampling_params=greedy(1000), stop=stop,
                              include_stop_str_in_output=True)
        async with setup.text.generate(request) as stream:
            result = await stream.collect_text()
        assert result.text == full[:start + len(stop)]
        assert result.finish_reason == FinishReason.stop(stop)
        assert success_total(setup.client) == {"stop": 1.0}


@pytest.mark.parametrize("speculative", [0, 3], ids=["one-token-steps", "multi-token-steps"])
async def test_outputs_that_pile_up_give_the_same_text_stop_and_abort(speculative: int) -> None:
    # An engine without step time outruns 8 consumers: most outputs are read from the
    # buffer (the stream's path without a coroutine), one or (speculative) several tokens
    # each. Text, kept tokens, the match and its one ABORT are those of the awaited path.
    full, start, stop = mid_stream_stop(count=120, at=60)
    ids = predicted(prompt_ids(), 120)
    kept = ids[:tokens_to_complete(ids, start + len(stop))]
    async with text_client(step_time=0.0, num_speculative_tokens=speculative) as setup:
        results: dict[str, list[TextOutput]] = {}
        internal: list[str] = []
        plain: list[TextOutput] = []

        async def one(name: str) -> None:
            request = TextRequest(request_id=name, prompt=PROMPT, stop=["@@@", stop],
                                  sampling_params=greedy(1000))
            async with setup.text.generate(request) as stream:
                results[name] = [out async for out in stream]
                internal.append(stream.request_id)

        async def no_text() -> None:
            request = TextRequest(prompt=PROMPT, sampling_params=greedy(100), detokenize=False)
            async with setup.text.generate(request) as stream:
                plain.extend([out async for out in stream])

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, f"s{i}")
            tg.start_soon(no_text)
        for outs in results.values():
            assert "".join(out.text for out in outs) == full[:start]
            assert [t for out in outs for t in out.token_ids] == kept
            assert [out.finish_reason for out in outs] == [None] * (len(outs) - 1) + [
                FinishReason.stop(stop)]
        assert [t for out in plain for t in out.token_ids] == predicted(prompt_ids(), 100)
        assert all(out.text == "" for out in plain)
        assert plain[-1].finish_reason == FinishReason.LENGTH
        await wait_until(lambda: len(setup.engine.aborted_ids) == 8)
        await anyio.sleep(0.05)
        assert sorted(setup.engine.aborted_ids) == sorted(internal)  # once each
        assert success_total(setup.client) == {"stop": 8.0, "length": 1.0}


async def test_min_tokens_ignores_a_stop_string_until_then() -> None:
    ids = predicted(prompt_ids(), 80)
    full = decoded(ids)
    stop = " the"
    early = full.find(stop)
    assert early >= 0 and tokens_to_complete(ids, early + len(stop)) < 10
    minimum = tokens_to_complete(ids, early + len(stop)) + 2
    async with text_client(step_time=0.002) as setup:
        request = TextRequest(prompt=PROMPT, sampling_params=greedy(1000, min_tokens=minimum),
                              stop=[stop])
        async with setup.text.generate(request) as stream:
            result = await stream.collect_text()
    assert result.finish_reason == FinishReason.stop(stop)
    assert len(result.token_ids) > minimum  # the early match did not count
    assert result.text.startswith(decoded(ids[:minimum]))
    assert full.startswith(result.text) and full[len(result.text):].startswith(stop)
    without = TextRequest(prompt=PROMPT, sampling_params=greedy(1000), stop=[stop])
    async with text_client(step_time=0.002) as setup, setup.text.generate(without) as stream:
        assert (await stream.collect_text()).text == full[:early]


async def test_a_stop_string_in_the_engines_last_output_sends_no_abort() -> None:
    ids = predicted(prompt_ids(), 40)
    # A last token whose text completes a string seen nowhere before: the match is in the
    # output the engine ends with (max_tokens).
    count, stop = next((n, decoded(ids[:n])[-4:]) for n in range(20, 40)
                       if decoded(ids[:n]).find(decoded(ids[:n])[-4:]) == len(
                           decoded(ids[:n])) - 4 and decoded(ids[:n]) != decoded(ids[:n - 1]))
    async with text_client() as setup:
        request = TextRequest(prompt=PROMPT, sampling_params=greedy(count), stop=stop)
        async with setup.text.generate(request) as stream:
            result = await stream.collect_text()
        assert result.finish_reason == FinishReason.stop(stop)
        assert result.token_ids == ids[:count]
        assert result.text == decoded(ids[:count])[:-4]
        await anyio.sleep(0.05)
        assert setup.engine.aborted_ids == []  # the engine had finished it already
        # Counted as vLLM counts it: the request stopped on a stop string, not on its length.
        assert success_total(setup.client) == {"stop": 1.0}


async def test_leaving_early_aborts_once() -> None:
    async with text_client(step_time=0.002) as setup:
        request = TextRequest(prompt=PROMPT, sampling_params=greedy(1000), stop=["@@"])
        async with setup.text.generate(request) as stream:
            async for _ in stream:
                break
            internal = stream.request_id
        await wait_until(lambda: setup.engine.aborted_ids == [internal])
        await anyio.sleep(0.05)
        assert setup.engine.aborted_ids == [internal]
        assert success_total(setup.client) == {"abort": 1.0}
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()


async def test_a_second_reader_gets_busy_resource_error() -> None:
    async with text_client(step_time=0.3) as setup:
        request = TextRequest(prompt=PROMPT, sampling_params=greedy(1000))
        async with setup.text.generate(request) as stream:
            await stream.__anext__()
            waiting = anyio.Event()

            async def reader() -> None:
                waiting.set()
                await stream.__anext__()

            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                await waiting.wait()
                await anyio.sleep(0.02)  # the reader waits for the next output
                with pytest.raises(anyio.BusyResourceError):
                    await stream.__anext__()
                tg.cancel_scope.cancel()


async def outputs(text: TextClient, request: TextRequest) -> AsyncGenerator[TextOutput, None]:
    async with text.generate(request) as stream:
        async for out in stream:
            yield out


async def test_an_async_generator_may_wrap_the_stream() -> None:
    async with text_client(step_time=0.002) as setup:
        request = TextRequest(prompt=PROMPT, sampling_params=greedy(1000))
        with anyio.fail_after(5):
            async with contextlib.aclosing(outputs(setup.text, request)) as outs:
                async for _ in outs:
                    break
        await wait_until(lambda: len(setup.engine.aborted_ids) == 1)
        assert setup.client.engine.in_flight == 0


async def test_an_engine_dying_mid_stream_fails_every_text_stream_once() -> None:
    # Two text streams in other tasks, the engine dies under them: each gets exactly one
    # EngineDeadError (not an exception group, not a hang), and the client stays failed.
    errors: list[BaseException] = []
    texts: list[str] = []

    async def consume(text_client_: TextClient, name: str) -> None:
        request = TextRequest(request_id=name, prompt=PROMPT, sampling_params=greedy(4000),
                              stop=["@@never@@"])
        received = ""
        try:
            async with text_client_.generate(request) as stream:
                async for out in stream:
                    received += out.text
        except EngineDeadError as exc:
            errors.append(exc)
        texts.append(received)

    async with text_client(step_time=0.002) as setup:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume, setup.text, "a")
                tg.start_soon(consume, setup.text, "b")
                await wait_until(lambda: len(setup.engine.running_ids) == 2)
                await anyio.sleep(0.05)
                setup.engine.die("test: the engine's busy loop raised")
        assert len(errors) == 2 and all(isinstance(e, EngineDeadError) for e in errors)
        assert all("ENGINE_CORE_DEAD" in str(e) for e in errors)
        assert all(text and "@@" not in text for text in texts)  # text came before the death
        with pytest.raises(EngineDeadError):
            async with setup.text.generate(TextRequest(prompt=PROMPT)):
                pytest.fail("entered")  # pragma: no cover


@pytest.mark.parametrize("per_step", [True, False], ids=["per-step", "coalesced"])
async def test_receive_nowait_takes_what_arrived_and_merges_to_the_same_text(
        per_step: bool) -> None:
    """A consumer that fell behind takes every buffered output at once; merged, they are
    the same delta as one by one (text, tokens, the finish of the last). Coalesced, the
    stream has merged them already: what arrived after the first output is one output."""
    async with text_client(step_time=0.0) as setup:
        params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
        async with setup.text.generate(TextRequest(prompt=PROMPT,
                                                   sampling_params=params)) as stream:
            alone = await stream.collect_text()
        async with setup.text.generate(TextRequest(prompt=PROMPT, sampling_params=params),
                                       per_step=per_step) as stream:
            first = await stream.__anext__()
            # the client's reader has buffered the last output (the request left its registry)
            await wait_until(lambda: setup.client.engine.in_flight == 0)
            outputs = [first]
            with pytest.raises(anyio.EndOfStream):
                while True:
                    outputs.append(stream.receive_nowait())
        assert len(outputs) > 2 if per_step else len(outputs) <= 2
        merged = merge_outputs(outputs)
        assert merged.text == alone.text and merged.token_ids == alone.token_ids
        assert merged.finish_reason == FinishReason.LENGTH
        assert merged.prompt_token_ids == first.prompt_token_ids is not None


async def test_receive_nowait_would_block_while_nothing_is_buffered() -> None:
    async with text_client(step_time=0.5) as setup:
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        async with setup.text.generate(TextRequest(prompt=PROMPT,
                                                   sampling_params=params)) as stream:
            await stream.__anext__()
            with pytest.raises(anyio.WouldBlock):
                stream.receive_nowait()



@pytest.mark.parametrize("per_step", [True, False], ids=["per-step", "coalesced"])
async def test_a_busy_consumer_gets_the_same_text_stop_and_logprobs_merged_or_per_step(
        per_step: bool) -> None:
    """The consumer falls behind by tens of steps, then reads on. Coalesced, the steps that
    waited come as a few outputs, and the stop string inside one of them cuts it at the
    right token, with one logprobs row per kept token and one ABORT; per step, one output
    per token. Text, tokens and logprobs are the same either way."""
    full, start, stop = mid_stream_stop(at=20)
    ids = predicted(prompt_ids(), 60)
    kept = ids[:tokens_to_complete(ids, start + len(stop))]
    async with text_client(step_time=0.002) as setup:
        request = TextRequest(prompt=PROMPT, sampling_params=greedy(1000, logprobs=1),
                              stop=[stop])
        async with setup.text.generate(request, per_step=per_step) as stream:
            outs = [await stream.__anext__()]
            await wait_until(lambda: setup.engine.steps >= len(kept) + 10)  # busy meanwhile
            outs += [out async for out in stream]
            internal = stream.request_id
            await wait_until(lambda: setup.engine.aborted_ids == [internal])
        assert "".join(out.text for out in outs) == full[:start]
        assert [t for out in outs for t in out.token_ids] == kept
        assert outs[-1].finish_reason == FinishReason.stop(stop)
        assert all(out.finish_reason is None for out in outs[:-1])
        for out in outs:  # one row per token, the sampled one first
            assert out.logprobs is not None
            assert [row[0].token_id for row in out.logprobs] == out.token_ids
        if per_step:
            assert len(outs) == len(kept)  # the mock makes one token a step
        else:
            assert len(outs) < len(kept) // 2
        await anyio.sleep(0.05)
        assert setup.engine.aborted_ids == [internal]
        assert success_total(setup.client) == {"stop": 1.0}
