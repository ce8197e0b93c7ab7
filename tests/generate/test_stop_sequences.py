"""Multi-token stop sequences, matched by the client across engine steps."""

from __future__ import annotations

import anyio
import pytest

from anyio_genout import FinishReason, FinishReasonKind

from .support import (
    LENGTH,
    finished_counts,
    generate_cluster,
    logprobs,
    mask,
    no_resource_warnings,
    output,
    request,
)

pytestmark = pytest.mark.anyio


async def test_match_split_across_two_steps_truncates_and_aborts_once() -> None:
    with no_resource_warnings():
        async with generate_cluster() as (client, (engine,)):
            req = request("req-stop", stop_token_sequences=[(5, 6)])
            async with client.generate(req) as stream:
                add = await engine.receive_add()
                internal = add.request.request_id
                assert "stop_token_sequences" not in add.sampling_wire  # client-side only
                await engine.send([output(internal, [4, 5], new_logprobs=logprobs([4, 5]),
                                          new_sampling_mask=mask([4], [5]))])
                await engine.send([output(internal, [6, 7], new_logprobs=logprobs([6, 7]),
                                          new_sampling_mask=mask([6, 1], [7, 1]))])
                collected = await stream.collect_output()
                with pytest.raises(StopAsyncIteration):
                    await stream.__anext__()
                # The engine is told to stop while the scope is still open.
                with anyio.fail_after(1):
                    abort = await engine.receive_abort()
                assert abort.request_ids == (internal,)
            # Kept: every token up to and including the sequence's last token (7 dropped).
            assert collected.token_ids == [4, 5, 6]
            assert collected.finish_reason == FinishReason.stop((5, 6))
            assert collected.finish_reason.kind is FinishReasonKind.STOP
            assert collected.finish_reason.stop_reason == (5, 6)
            assert collected.finish_reason.as_str() == "stop"
            assert collected.logprobs is not None
            assert [p.sampled.token_id for p in collected.logprobs.positions] == [4, 5, 6]
            assert collected.sampling_mask is not None
            assert collected.sampling_mask.rows == [[4], [5], [6, 1]]
            await engine.expect_nothing(0.1)  # one ABORT, not a second one on scope exit
            assert finished_counts(client) == {"stop": 1}
            assert len(client.inflight) == 0 and client.engine.in_flight == 0


async def test_match_on_the_last_allowed_token_needs_no_abort() -> None:
    async with generate_cluster() as (client, (engine,)):
        req = request("req-stop-last", max_tokens=3, stop_token_sequences=[(9, 9, 9), (5, 6)])
        async with client.generate(req) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(internal, [4, 5])])
            await engine.send([output(internal, [6], LENGTH)])  # max_tokens reached
            outs = [out async for out in stream]
        assert [t for o in outs for t in o.token_ids] == [4, 5, 6]
        assert outs[-1].finish_reason == FinishReason.stop((5, 6))
        await engine.expect_nothing(0.1)  # the engine had finished the request already
        assert finished_counts(client) == {"stop": 1}


async def test_engine_stop_without_a_sequence_match_keeps_the_engine_reason() -> None:
    async with generate_cluster() as (client, (engine,)):
        req = request("req-nostop", stop_token_sequences=[(5, 6)])
        async with client.generate(req) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(internal, [5, 4])])
            await engine.send([output(internal, [6], LENGTH)])
            collected = await stream.collect_output()
        assert collected.token_ids == [5, 4, 6]
        assert collected.finish_reason == FinishReason.LENGTH
        await engine.expect_nothing(0.1)
        assert finished_counts(client) == {"length": 1}


@pytest.mark.parametrize(("min_tokens", "steps", "expected", "finish"), [
    # (5, 6) ends at token 2 = min_tokens: not a stop (vLLM: only after min_tokens tokens);
    # it ends again at token 4, beginning within the first min_tokens tokens: a stop.
    (2, [[5, 6, 5], [6, 9]], [[5, 6, 5], [6]], FinishReason.stop((5, 6))),
    (0, [[5, 6, 5], [6, 9]], [[5, 6]], FinishReason.stop((5, 6))),
    (1, [[5, 6, 5], [6, 9]], [[5, 6]], FinishReason.stop((5, 6))),
    # The case: a sequence at tokens 2-3 with min_tokens=10 never stops the request.
    (10, [[1, 5, 6, 1, 1], [1] * 5, [1] * 5, [1] * 5], [[1, 5, 6, 1, 1], [1] * 5, [1] * 5,
                                                         [1] * 5], FinishReason.LENGTH),
])
async def test_min_tokens_holds_back_stop_sequences_like_vllm(
        min_tokens: int, steps: list[list[int]], expected: list[list[int]],
        finish: FinishReason) -> None:
    async with generate_cluster() as (client, (engine,)):
        req = request("req-min", max_tokens=20, min_tokens=min_tokens,
                      stop_token_sequences=[(5, 6)])
        async with client.generate(req) as stream:
            internal = (await engine.receive_add()).request.request_id
            for i, step in enumerate(steps):
                last = i == len(steps) - 1 and finish.kind is FinishReasonKind.LENGTH
                await engine.send([output(internal, step, LENGTH if last else None)])
            outs = [out async for out in stream]
        assert [t for o in outs for t in o.token_ids] == [t for s in expected for t in s]
        assert outs[-1].finish_reason == finish
        assert finished_counts(client) == {finish.as_str(): 1}
        if finish.kind is FinishReasonKind.STOP:
            assert (await engine.receive_abort()).request_ids == (internal,)
        await engine.expect_nothing(0.05)
