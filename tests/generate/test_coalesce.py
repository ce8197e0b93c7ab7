"""Coalescing (issue 23, item 4): the steps of a request that wait while its consumer is
busy come as one merged output; ``client.generate(request, per_step=True)`` gives one
output per engine step.

The fake engine sends each step as its own message (its own batch timestamp). A probe
request's terminal output, sent after them, tells the test that the client's reader has
buffered every step before the consumer reads: the engine's messages arrive in order."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from anyio_genout import Client, FinishReason, GenerateOutput, GenerateStream, RequestFailedError
from anyio_genout.generate.coalesce import MAX_MERGED
from anyio_genout.protocol import EngineCoreOutput, Logprobs
from tests.engine.fake import FakeEngine

from .support import (
    LENGTH,
    PREEMPTED,
    QUEUED,
    SCHEDULED,
    STOP,
    finished_counts,
    generate_cluster,
    logprobs,
    mask,
    output,
    prefill,
    request,
    scrape,
    unique_model_name,
)

pytestmark = pytest.mark.anyio

PER_STEP = pytest.mark.parametrize("per_step", [True, False], ids=["per-step", "coalesced"])


class Busy:
    """A stream whose consumer was busy: :meth:`steps` buffers outputs before it reads."""

    def __init__(self, client: Client, engine: FakeEngine, stream: GenerateStream,
                 internal: str, probe: GenerateStream, probe_id: str) -> None:
        self.client = client
        self.engine = engine
        self.stream = stream
        self.internal = internal
        self._probe = probe
        self._probe_id = probe_id

    async def steps(self, *steps: EngineCoreOutput, start: float = 100.0,
                    then_drop: bool = False) -> None:
        """Send each of ``steps`` as its own engine message (10 ms apart on the engine
        clock), then (``then_drop``) a message that drops the request without a terminal
        output; wait until the client's reader has buffered them all."""
        for i, step in enumerate(steps):
            await self.engine.send([step], timestamp=start + 0.01 * i)
        if then_drop:
            await self.engine.send([], finished_requests=frozenset({self.internal}))
        await self.engine.send([output(self._probe_id, [0])], timestamp=start + 99)
        with anyio.fail_after(5):
            await self._probe.__anext__()

    async def finish_probe(self) -> None:
        await self.engine.send([output(self._probe_id, [0], LENGTH)])
        with anyio.fail_after(5):
            await self._probe.collect_output()

    async def read_all(self) -> list[GenerateOutput]:
        with anyio.fail_after(5):
            return [out async for out in self.stream]


@asynccontextmanager
async def busy(per_step: bool, model_name: str = "coalesce", **params: Any
               ) -> AsyncIterator[Busy]:
    """A client over one fake engine, a stream of ``request("r", **params)`` and a probe."""
    async with generate_cluster(model_name=model_name) as (client, (engine,)), \
            client.generate(request("r", **params), per_step=per_step) as stream, \
            client.generate(request("probe")) as probe:
        internal = (await engine.receive_add()).request.request_id
        probe_id = (await engine.receive_add()).request.request_id
        setup = Busy(client, engine, stream, internal, probe, probe_id)
        yield setup
        await setup.finish_probe()  # it ends as "length"


def tokens_of(outs: Sequence[GenerateOutput]) -> list[list[int]]:
    return [out.token_ids for out in outs]


@PER_STEP
async def test_a_busy_consumer_gets_the_waiting_steps_as_one_output_in_order(
        per_step: bool) -> None:
    async with busy(per_step, max_tokens=6) as b:
        r = b.internal
        await b.steps(output(r, [1], prefill_stats=prefill(num_prompt_tokens=2,
                                                            num_computed_tokens=2,
                                                            num_cached_tokens=1)),
                      output(r, [2, 3]), output(r, [4]), output(r, [5]), output(r, [6], LENGTH))
        outs = await b.read_all()
    if per_step:
        assert tokens_of(outs) == [[1], [2, 3], [4], [5], [6]]
        assert [out.finish_reason for out in outs] == [None] * 4 + [FinishReason.LENGTH]
        assert all(out.prompt_info is None for out in outs[1:])
    else:
        assert tokens_of(outs) == [[1, 2, 3, 4, 5, 6]]
        assert outs[0].finish_reason == FinishReason.LENGTH
    # The merge keeps the first step's prompt info and its cached tokens.
    assert outs[0].prompt_token_ids == (11, 22) and outs[0].cached_token_count == 1
    assert finished_counts(b.client) == {"length": 2}  # the request and the probe


@PER_STEP
async def test_plain_steps_merged_come_to_receive_as_their_token_ids(per_step: bool) -> None:
    async with busy(per_step, max_tokens=None) as b:
        r = b.internal
        await b.steps(output(r, [1]))
        first = await b.stream.receive()
        assert isinstance(first, GenerateOutput) and first.token_ids == [1]  # the prompt's
        await b.steps(output(r, [2]), output(r, [3, 4]), output(r, [5]), start=200.0)
        got = [await b.stream.receive() for _ in range(3 if per_step else 1)]
    assert got == ([[2], [3, 4], [5]] if per_step else [[2, 3, 4, 5]])


@PER_STEP
async def test_the_finish_reason_is_the_last_steps(per_step: bool) -> None:
    async with busy(per_step, max_tokens=None) as b:
        r = b.internal
        await b.steps(output(r, [1]), output(r, [2]), output(r, [9], STOP, stop_reason=9))
        outs = await b.read_all()
    assert [t for out in outs for t in out.token_ids] == [1, 2, 9]
    assert outs[-1].finish_reason == FinishReason.stop(9)
    assert len(outs) == (3 if per_step else 1)
    assert finished_counts(b.client) == {"stop": 1, "length": 1}


@PER_STEP
async def test_logprobs_and_sampling_mask_rows_are_stacked_in_step_order(
        per_step: bool) -> None:
    async with busy(per_step, max_tokens=4, logprobs=1) as b:
        r = b.internal
        steps = [[1], [2, 3], [4]]
        rows = [[[1, 7]], [[2], [3, 8]], [[4, 9, 10]]]
        await b.steps(*(output(r, s, LENGTH if i == 2 else None, new_logprobs=logprobs(s),
                               new_sampling_mask=mask(*rows[i]))
                        for i, s in enumerate(steps)))
        outs = await b.read_all()
    assert len(outs) == (3 if per_step else 1)
    merged = Logprobs.concat([out.logprobs for out in outs if out.logprobs is not None])
    assert merged == Logprobs.concat([logprobs(s) for s in steps])
    mask_rows = []
    for out in outs:  # each output's rows are its own tokens'
        assert out.logprobs is not None and out.sampling_mask is not None
        assert [p.sampled.token_id for p in out.logprobs.positions] == out.token_ids
        assert len(out.sampling_mask) == len(out.token_ids)
        mask_rows += out.sampling_mask.rows
    assert mask_rows == [[1, 7], [2], [3, 8], [4, 9, 10]]


@PER_STEP
async def test_a_stop_sequence_inside_a_merge_cuts_there_and_frees_the_request(
        per_step: bool) -> None:
    async with busy(per_step, max_tokens=None, stop_token_sequences=[(3, 4)]) as b:
        r = b.internal
        await b.steps(output(r, [1]), output(r, [2, 3]), output(r, [4, 5]), output(r, [6]),
                      output(r, [7]))
        outs = await b.read_all()
        with anyio.fail_after(1):
            abort = await b.engine.receive_abort()
        assert abort.request_ids == (r,)
        await b.engine.expect_nothing(0.1)  # once
    assert [t for out in outs for t in out.token_ids] == [1, 2, 3, 4]  # 5, 6, 7 dropped
    assert tokens_of(outs) == ([[1], [2, 3], [4]] if per_step else [[1, 2, 3, 4]])
    assert outs[-1].finish_reason == FinishReason.stop((3, 4))
    assert finished_counts(b.client) == {"stop": 1, "length": 1}
    assert len(b.client.inflight) == 0 and b.client.engine.in_flight == 0


def _engine_clock_samples(client: Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The client's samples without the model name label and without the two families
    timed on the wall clock (time to first token, end-to-end latency)."""
    wall = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds")
    return {(name, frozenset((k, v) for k, v in labels if k != "model_name")): value
            for (name, labels), value in scrape(client).items()
            if not name.startswith(wall)}


async def test_the_metrics_are_the_same_with_and_without_coalescing() -> None:
    """Every step is observed on its own: inter-token latency (one per step after the
    first, on the engine clock), generation tokens and the per-request histograms."""
    samples = []
    counts = []
    for per_step in (True, False):
        async with busy(per_step, unique_model_name("coalesce-metrics"), max_tokens=None) as b:
            r = b.internal
            steps = [output(r, [1], None, (QUEUED, 90.0), (SCHEDULED, 95.0),
                            prefill_stats=prefill(num_prompt_tokens=2, num_computed_tokens=2))]
            steps += [output(r, [i] * (1 + i % 3)) for i in range(2, 12)]
            # Inside a run of plain steps: a preemption (an event, so not a plain step) and
            # a step without tokens.
            steps[5:5] = [output(r, [5], None, (PREEMPTED, 99.0)), output(r, [])]
            await b.steps(*steps)
            await b.steps(output(r, [12], LENGTH), start=300.0)
            outs = await b.read_all()
            counts.append(len(outs))
            samples.append(_engine_clock_samples(b.client))
    assert counts[0] == 14 and counts[1] < 14  # the second run did merge
    assert samples[0] == samples[1]
    itl = {labels: v for (name, labels), v in samples[1].items()
           if name == "vllm:inter_token_latency_seconds_count"}
    # The request's 13 token-bearing steps give 12, the probe's two outputs so far one.
    assert sorted(itl.values())[-1] == 12 + 1
    tokens = {labels: v for (name, labels), v in samples[1].items()
              if name == "vllm:generation_tokens_total"}
    assert sorted(tokens.values())[-1] == 1 + sum(1 + i % 3 for i in range(2, 12)) + 1 + 1 + 2
    preemptions = {labels: v for (name, labels), v in samples[1].items()
                   if name == "vllm:num_preemptions_total"}
    assert sorted(preemptions.values())[-1] == 1


async def test_steps_of_different_shape_are_not_merged() -> None:
    """Logprobs on some steps only, a second transfer-params dict: each run of steps of one
    shape is one output, so no row is misaligned and no value is lost."""
    async with busy(False, max_tokens=None, logprobs=1) as b:
        r = b.internal
        await b.steps(output(r, [1], new_logprobs=logprobs([1])),
                      output(r, [2], new_logprobs=logprobs([2])),
                      output(r, [3]), output(r, [4]),
                      output(r, [5], kv_transfer_params={"hop": 1}),
                      output(r, [6], kv_transfer_params={"hop": 2}),
                      output(r, [7], LENGTH, new_logprobs=logprobs([7])))
        outs = await b.read_all()
    assert tokens_of(outs) == [[1, 2], [3, 4, 5], [6], [7]]
    assert [out.logprobs is not None for out in outs] == [True, False, False, True]
    assert [out.kv_transfer_params for out in outs] == [None, {"hop": 1}, {"hop": 2}, None]
    assert outs[-1].finish_reason == FinishReason.LENGTH


async def test_a_merge_takes_at_most_max_merged_steps() -> None:
    async with busy(False, max_tokens=None) as b:
        r = b.internal
        count = MAX_MERGED + 10
        await b.steps(*(output(b.internal, [i]) for i in range(count)),
                      output(r, [count], LENGTH))
        outs = await b.read_all()
    assert [len(out.token_ids) for out in outs] == [MAX_MERGED, 11]
    assert [t for out in outs for t in out.token_ids] == list(range(count + 1))


@PER_STEP
async def test_an_error_after_buffered_steps_comes_after_them(per_step: bool) -> None:
    async with busy(per_step, max_tokens=None) as b:
        r = b.internal
        # Then the engine drops the request without a terminal output: the stream's error.
        await b.steps(output(r, [1]), output(r, [2]), output(r, [3]), then_drop=True)
        outs = []
        with pytest.raises(RequestFailedError):
            async for out in b.stream:
                outs.append(out)
    assert tokens_of(outs) == ([[1], [2], [3]] if per_step else [[1, 2, 3]])
