"""The generate tests of the reference list (llm crate ``tests/generate.rs``), both backends.

Each test drives the generate ``Client`` against scripted fake engines and checks what the
engine receives and what the stream yields, with the same observable results as the reference.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from anyio_genout import (
    DuplicateRequestIdError,
    FinishReason,
    GenerateOutput,
    RequestStreamClosedError,
    SamplingMaskMismatchError,
    collect_output,
)
from anyio_genout.errors import IncompleteStreamError

from .support import (
    LENGTH,
    PREEMPTED,
    QUEUED,
    SCHEDULED,
    STOP,
    finished_counts,
    generate_cluster,
    histogram_count,
    internal_id_pattern,
    logprobs,
    mask,
    no_resource_warnings,
    output,
    prefill,
    request,
    sample,
    scrape,
    unique_model_name,
)

pytestmark = pytest.mark.anyio


async def test_generate_streams_outputs() -> None:
    # Per step: each output is one engine step's delta (merged ones: test_coalesce.py).
    first_lp, last_lp, prompt_lp = logprobs([1, 2]), logprobs([3]), logprobs([11, 22], top=2)
    async with generate_cluster(client_index=7) as (client, (engine,)):
        async with client.generate(request("req-delta"), per_step=True) as stream:
            add = await engine.receive_add()
            internal = add.request.request_id
            assert internal_id_pattern("req-delta").match(internal)
            assert internal != "req-delta"
            assert add.request.external_req_id == "req-delta"
            assert add.request.client_index == 7
            assert add.request.prompt_token_ids == (11, 22)
            assert stream.request_id == internal
            assert stream.external_request_id == "req-delta"
            await engine.send([
                output(internal, [1, 2], new_logprobs=first_lp, new_prompt_logprobs=prompt_lp),
                output(internal, [3], LENGTH, new_logprobs=last_lp),
            ])
            first = await stream.__anext__()
            assert first.request_id == stream.request_id
            assert first.prompt_info is not None
            assert first.prompt_info.prompt_token_ids == (11, 22)
            assert first.prompt_info.prompt_logprobs == prompt_lp
            assert first.prompt_info.prompt_token_id_logprobs is None
            assert first.prompt_token_ids == (11, 22) and first.prompt_logprobs == prompt_lp
            assert first.token_ids == [1, 2]
            assert first.logprobs == first_lp
            assert first.finish_reason is None and not first.finished
            second = await stream.__anext__()
            assert second.request_id == internal
            assert second.prompt_info is None
            assert second.token_ids == [3]
            assert second.logprobs == last_lp
            assert second.finish_reason == FinishReason.LENGTH and second.finished
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
        await engine.expect_nothing(0.1)  # a finished request is not aborted
        assert finished_counts(client) == {"length": 1}
        assert len(client.inflight) == 0 and client.engine.in_flight == 0


async def test_collect_output_aggregates_raw_tokens_logprobs_and_terminal_metadata() -> None:
    prompt_lp = logprobs([11, 22])
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("req-collect")) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(
                internal, [33],
                prefill_stats=prefill(num_prompt_tokens=2, num_cached_tokens=1,
                                      num_local_cached_tokens=1),
                new_sampling_mask=mask([1, 33, 99]),
                new_logprobs=logprobs([33]),
                new_prompt_logprobs=prompt_lp,
            )], timestamp=1.0)
            await engine.send([output(
                internal, [44], STOP,
                new_sampling_mask=mask([2, 44, 88]),
                new_logprobs=logprobs([44]),
                kv_transfer_params={"connector": "x"},
            )], timestamp=2.0)
            collected = await stream.collect_output()
        assert collected.request_id == internal
        assert collected.prompt_token_ids == (11, 22)
        assert collected.token_ids == [33, 44]
        assert collected.finish_reason == FinishReason.stop_eos() == FinishReason.stop(None)
        assert collected.finish_reason.stop_reason is None
        assert collected.finish_reason.as_str() == "stop"
        assert collected.usage.prompt_token_count == 2
        assert collected.usage.output_token_count == 2
        assert collected.usage.cached_token_count == 1
        assert collected.prompt_logprobs == prompt_lp
        assert collected.logprobs is not None and len(collected.logprobs) == 2
        assert [p.sampled.token_id for p in collected.logprobs.positions] == [33, 44]
        assert collected.kv_transfer_params == {"connector": "x"}
        assert collected.sampling_mask is not None
        assert collected.sampling_mask.rows == [[1, 33, 99], [2, 44, 88]]
        assert finished_counts(client) == {"stop": 1}


class InMemoryOutputs:
    """An async iterable of ready-made outputs (no engine, no generator to finalize)."""

    def __init__(self, *outputs: GenerateOutput) -> None:
        self._outputs = list(outputs)

    def __aiter__(self) -> AsyncIterator[GenerateOutput]:
        return self

    async def __anext__(self) -> GenerateOutput:
        await anyio.lowlevel.checkpoint()
        if not self._outputs:
            raise StopAsyncIteration
        return self._outputs.pop(0)


async def test_collect_output_rejects_partial_sampling_mask() -> None:
    stream = InMemoryOutputs(GenerateOutput("req-mask", [1, 2], finish_reason=FinishReason.LENGTH,
                                            sampling_mask=mask([1, 2, 3])))
    with pytest.raises(SamplingMaskMismatchError, match="1 rows for 2 tokens"):
        await collect_output(stream)


async def test_collect_output_over_an_in_memory_iterable() -> None:
    stream = InMemoryOutputs(
        GenerateOutput("req-mem", [1], sampling_mask=mask([1, 5]), cached_token_count=3),
        GenerateOutput("req-mem", [], cached_token_count=1),
        GenerateOutput("req-mem", [2, 3], finish_reason=FinishReason.repetition(7),
                       sampling_mask=mask([2], [3, 4]), ec_transfer_params={"ec": 1},
                       spec_decode_metrics={"accepted": 2}),
    )
    collected = await collect_output(stream)
    assert collected.request_id == "req-mem"
    assert collected.token_ids == [1, 2, 3]
    assert collected.finish_reason == FinishReason.repetition(7)
    assert collected.finish_reason.as_str() == "repetition"
    assert collected.finish_reason.stop_reason == 7
    assert collected.usage.cached_token_count == 3  # the maximum seen
    assert collected.usage.output_token_count == 3
    assert collected.prompt_token_ids == () and collected.logprobs is None
    assert collected.sampling_mask is not None
    assert collected.sampling_mask.rows == [[1, 5], [2], [3, 4]]
    assert collected.ec_transfer_params == {"ec": 1}
    assert collected.spec_decode_metrics == {"accepted": 2}


async def test_collect_output_without_a_terminal_output_raises() -> None:
    with pytest.raises(IncompleteStreamError, match="req-cut"):
        await collect_output(InMemoryOutputs(GenerateOutput("req-cut", [1, 2])))


async def test_generate_propagates_unexpected_close_errors() -> None:
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("req-closed")) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([], finished_requests=frozenset({internal}))
            with pytest.raises(RequestStreamClosedError) as info:
                await stream.__anext__()
            assert info.value.request_id == internal
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
        await engine.expect_nothing(0.1)  # the engine dropped it already: no ABORT
        assert finished_counts(client) == {}  # never recorded on the error path
        assert histogram_count(client, "vllm:e2e_request_latency_seconds") == 0
        assert len(client.inflight) == 0


async def test_dropping_a_live_generate_stream_triggers_abort() -> None:
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("req-drop")) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(internal, [99])])
            async for out in stream:
                assert out.token_ids == [99]
                break
        with anyio.fail_after(1):
            abort = await engine.receive_abort()
        assert abort.request_ids == (internal,)
        await engine.expect_nothing(0.1)
        assert len(client.inflight) == 0 and client.engine.in_flight == 0


async def test_duplicate_external_request_ids_are_randomized_before_reaching_engine() -> None:
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("req-dup")) as first, \
                client.generate(request("req-dup")) as second:
            adds = [await engine.receive_add(), await engine.receive_add()]
            assert [a.request.external_req_id for a in adds] == ["req-dup", "req-dup"]
            ids = [a.request.request_id for a in adds]
            assert all(internal_id_pattern("req-dup").match(i) for i in ids)
            assert ids[0] != ids[1]
            assert ids == [first.request_id, second.request_id]
            assert client.inflight.resolve(["req-dup"]) == ids
            await engine.send([output(i, [], LENGTH) for i in ids])
            collected = [await first.collect_output(), await second.collect_output()]
        assert [c.request_id for c in collected] == ids
        assert all(c.finish_reason == FinishReason.LENGTH and c.token_ids == []
                   for c in collected)
        assert len(client.inflight) == 0


async def test_duplicate_request_ids_bubble_up_when_randomization_is_off() -> None:
    async with generate_cluster(randomize_request_ids=False) as (client, (engine,)), \
            client.generate(request("req-dup")) as stream:
        add = await engine.receive_add()
        assert add.request.request_id == "req-dup"
        with pytest.raises(DuplicateRequestIdError) as info:
            async with client.generate(request("req-dup")):
                pytest.fail("entered a duplicate")  # pragma: no cover
        assert info.value.request_id == "req-dup"
        await engine.expect_nothing(0.2)  # no second ADD
        assert client.inflight.resolve(["req-dup"]) == ["req-dup"]
        await engine.send([output("req-dup", [], LENGTH)])
        assert [o.finish_reason async for o in stream] == [FinishReason.LENGTH]


async def test_abort_resolves_external_request_id_to_internal_before_reaching_engine() -> None:
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("req-abort")) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(internal, [7])])
            first = await stream.__anext__()
            assert first.token_ids == [7]
            with anyio.fail_after(1):
                await client.abort(["req-abort"])
                abort = await engine.receive_abort()
            assert abort.request_ids == (internal,)  # the internal id, not "req-abort"
            with anyio.fail_after(1):
                rest = [out async for out in stream]
        assert len(rest) == 1
        assert rest[0].request_id == internal
        assert rest[0].finish_reason == FinishReason.ABORT
        assert rest[0].token_ids == [] and rest[0].prompt_info is None
        await engine.expect_nothing(0.1)  # no second ABORT when the scope closes
        assert finished_counts(client) == {"abort": 1}
        assert len(client.inflight) == 0


async def test_abort_by_external_id_aborts_all_internal_requests() -> None:
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("req-dup-abort")) as first, \
                client.generate(request("req-dup-abort")) as second:
            ids = [(await engine.receive_add()).request.request_id for _ in range(2)]
            await engine.send([output(ids[0], [7]), output(ids[1], [8])])
            assert (await first.__anext__()).token_ids == [7]
            assert (await second.__anext__()).token_ids == [8]
            with anyio.fail_after(1):
                await client.abort(["req-dup-abort"])
                abort = await engine.receive_abort()
            assert sorted(abort.request_ids) == sorted(ids)
            await engine.expect_nothing(0.1)  # ONE frame for both
            for stream in (first, second):
                rest = [out async for out in stream]
                assert [(o.finish_reason, o.token_ids) for o in rest] == [
                    (FinishReason.ABORT, [])]
        assert finished_counts(client) == {"abort": 2}


async def test_abort_with_unknown_or_no_ids() -> None:
    async with generate_cluster() as (client, (engine,)):
        await client.abort(["nobody"])  # unknown: nothing sent
        await engine.expect_nothing(0.05)
        async with client.generate(request("a")) as first, \
                client.generate(request("b")) as second:
            ids = [(await engine.receive_add()).request.request_id for _ in range(2)]
            await client.abort(["nobody"])
            await engine.expect_nothing(0.05)
            await client.abort()  # empty: everything in flight
            abort = await engine.receive_abort()
            assert sorted(abort.request_ids) == sorted(ids)
            for stream in (first, second):
                assert [o.finish_reason async for o in stream] == [FinishReason.ABORT]


async def test_generate_records_request_metrics_in_prometheus_output() -> None:
    model = unique_model_name("generate-metrics")
    async with generate_cluster(5, model_name=model) as (client, engines):
        engine = engines[4]
        req = request("req-metrics", arrival_time=None, data_parallel_rank=4)
        async with client.generate(req) as stream:
            add = await engine.receive_add()
            internal = add.request.request_id
            assert stream.engine_index == 4
            await engine.send([output(
                internal, [1], None, (QUEUED, 8.0), (SCHEDULED, 9.0),
                prefill_stats=prefill(num_prompt_tokens=2, num_computed_tokens=2),
            )], timestamp=10.0)
            await engine.send([output(internal, [2, 3], LENGTH, (PREEMPTED, 10.5))],
                              timestamp=11.5)
            outs = [out async for out in stream]
        assert [t for o in outs for t in o.token_ids] == [1, 2, 3]
        samples = scrape(client)

        def value(name: str, **extra: str) -> float | None:
            return sample(samples, name, 4, model, **extra)

        assert value("vllm:request_success_total", finished_reason="length") == 1
        for other in ("stop", "abort", "error", "repetition"):
            assert value("vllm:request_success_total", finished_reason=other) == 0
        assert value("vllm:prompt_tokens_total") == 2
        assert value("vllm:prompt_tokens_by_source_total", source="local_compute") == 2
        assert value("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 0
        assert value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
        assert value("vllm:prompt_tokens_cached_total") == 0
        assert value("vllm:generation_tokens_total") == 3
        assert value("vllm:num_preemptions_total") == 1
        assert value("vllm:request_num_preemptions_sum") == 1.0
        assert value("vllm:request_num_preemptions_count") == 1
        for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                     "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                     "vllm:request_generation_tokens", "vllm:request_prefill_kv_computed_tokens",
                     "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                     "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                     "vllm:request_time_per_output_token_seconds",
                     "vllm:request_params_max_tokens", "vllm:request_params_n"):
            assert value(f"{name}_count") == 1, name
        # Engine clock: ITL 11.5 - 10, queue 9 - 8, prefill 10 - 9, decode 11.5 - 10.
        assert value("vllm:inter_token_latency_seconds_sum") == pytest.approx(1.5)
        assert value("vllm:request_queue_time_seconds_sum") == pytest.approx(1.0)
        assert value("vllm:request_prefill_time_seconds_sum") == pytest.approx(1.0)
        assert value("vllm:request_decode_time_seconds_sum") == pytest.approx(1.5)
        assert value("vllm:request_inference_time_seconds_sum") == pytest.approx(2.5)
        assert value("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.75)
        assert value("vllm:request_prompt_tokens_sum") == 2
        assert value("vllm:request_generation_tokens_sum") == 3
        assert value("vllm:request_prefill_kv_computed_tokens_sum") == 2
        assert value("vllm:request_params_max_tokens_sum") == 8
        # Wall clock (arrival None -> now): TTFT and e2e are small and non-negative.
        assert 0 <= (value("vllm:time_to_first_token_seconds_sum") or 0) < 5
        assert 0 <= (value("vllm:e2e_request_latency_seconds_sum") or 0) < 5
        # Nothing was recorded against the other engines.
        assert all(labels.get("engine") == "4"
                   for (name, label_set), v in samples.items()
                   if name.startswith("vllm:request_success") and v
                   for labels in [dict(label_set)])


async def test_dropping_stream_records_abort_terminal_request_metrics() -> None:
    model = unique_model_name("generate-drop-metrics")
    with no_resource_warnings():
        await _drop_and_check_metrics(model)


async def _drop_and_check_metrics(model: str) -> None:
    async with generate_cluster(6, model_name=model) as (client, engines):
        engine = engines[5]
        req = request("req-drop-metrics", arrival_time=None, data_parallel_rank=5)
        async with client.generate(req) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(internal, [99], None, (QUEUED, 1.0), (SCHEDULED, 2.0))],
                              timestamp=3.0)
            async for out in stream:
                assert out.token_ids == [99]
                break
        with anyio.fail_after(1):
            abort = await engine.receive_abort()
        assert abort.request_ids == (internal,)
        samples = scrape(client)
        assert sample(samples, "vllm:request_success_total", 5, model,
                      finished_reason="abort") == 1
        assert sample(samples, "vllm:e2e_request_latency_seconds_count", 5, model) == 1
        assert sample(samples, "vllm:request_num_preemptions_sum", 5, model) == 0.0
        assert sample(samples, "vllm:request_num_preemptions_count", 5, model) == 1


async def test_abort_wakes_a_consumer_waiting_in_another_task() -> None:
    async with generate_cluster() as (client, (engine,)):
        outs: list[GenerateOutput] = []

        async def consume() -> None:
            async with client.generate(request("req-wake")) as stream:
                outs.extend([out async for out in stream])

        with anyio.fail_after(2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                internal = (await engine.receive_add()).request.request_id
                await anyio.sleep(0.02)  # the consumer is waiting for an output
                await client.abort(["req-wake"])
        assert [(o.request_id, o.finish_reason, o.token_ids) for o in outs] == [
            (internal, FinishReason.ABORT, [])]
        assert (await engine.receive_abort()).request_ids == (internal,)
        await engine.expect_nothing(0.1)


async def test_abort_of_a_finished_but_held_stream_is_a_noop() -> None:
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("req-held")) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(internal, [1], LENGTH)])
            assert [o.token_ids async for o in stream] == [[1]]
            assert client.inflight.resolve(["req-held"]) == [internal]  # still held
            await client.abort(["req-held"])
            await engine.expect_nothing(0.1)
        assert client.inflight.resolve(["req-held"]) == []
        assert finished_counts(client) == {"length": 1}
