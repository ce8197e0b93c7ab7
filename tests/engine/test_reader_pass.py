"""How much a reader pass hands over: at least ``READ_BATCH`` messages, and more while the
pass is shorter than ``READ_PASS``.

A reader that is behind an engine finishing requests faster than they are read finds long
runs of one-row messages queued. Handing them over 16 at a time (the batch then) cost a
loop pass and a consumer wake-up per 16 tokens (the server bench: 25-36 % of its CPU per
token on asyncio). The pass is timed on the reader's clock, replaced here by one that
moves a fixed step per reading, so the pass lengths do not depend on the machine's speed.
"""

from __future__ import annotations

import time

import pytest

from anyio_genout.engine import reader
from anyio_genout.protocol import (
    EngineCoreFinishReason,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SamplingParams,
    encode_outputs,
)

from .fake import Cluster

pytestmark = pytest.mark.anyio

#: The fake clock's step per reading: a pass is READ_PASS / STEP messages, 2.5 READ_BATCH.
STEP = reader.READ_PASS / (2.5 * reader.READ_BATCH)
MESSAGES = 25 * reader.READ_BATCH


class _SteppingClock:
    def __init__(self) -> None:
        self.now = time.perf_counter()

    def __call__(self) -> float:
        self.now += STEP
        return self.now


async def _wake_ups(monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Queue MESSAGES one-row messages of one request before the reader runs; return (the
    consumer's wake-ups, the tokens it got)."""
    monkeypatch.setattr(reader, "_clock", _SteppingClock())
    request = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2],
                                sampling_params=SamplingParams(max_tokens=MESSAGES),
                                arrival_time=1.0)
    async with Cluster() as (client, (engine,)), client.call(request) as stream:
        await engine.receive_add()
        assert engine.output is not None
        for n in range(MESSAGES):
            finish = EngineCoreFinishReason.LENGTH if n == MESSAGES - 1 else None
            message = EngineCoreOutputs(engine_index=0, outputs=[
                EngineCoreOutput("r", [n + 1], finish_reason=finish)])
            assert engine.output.send_nowait(encode_outputs(message))
        # Blocking on purpose: ZeroMQ's I/O thread moves every message into the client's
        # queue while its reader cannot run, so it finds all of them waiting.
        time.sleep(0.3)  # noqa: ASYNC251
        wakes = 0
        tokens: list[int] = []
        async for item in stream:
            wakes += 1
            tokens += item.output.new_token_ids
            finished = item.output.finish_reason is not None
            while not finished and (output := stream.receive_output_nowait()) is not None:
                tokens += output.new_token_ids
                finished = output.finish_reason is not None
    return wakes, len(tokens)


async def test_a_backlog_of_small_messages_goes_over_in_passes_of_the_read_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    wakes, tokens = await _wake_ups(monkeypatch)
    assert tokens == MESSAGES  # nothing lost
    per_pass = reader.READ_PASS / STEP
    # READ_BATCH messages a pass would wake the consumer 25 times; passes of 2.5 times that
    # wake it about 10 times (the last pass, and the consumer's own first look, add at most
    # two; on trio, whose scheduler may run the reader's next pass before the consumer, as
    # few as 5) ...
    assert wakes <= MESSAGES / per_pass + 3 < MESSAGES / reader.READ_BATCH
    # ... and the reader still yields between passes: the backlog is not one pass.
    assert wakes >= MESSAGES / per_pass / 2 - 2


async def test_a_pass_takes_at_least_read_batch_messages_however_long_they_take(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "READ_PASS", 0.0)
    wakes, tokens = await _wake_ups(monkeypatch)
    assert tokens == MESSAGES
    assert MESSAGES / reader.READ_BATCH / 2 - 2 <= wakes <= MESSAGES / reader.READ_BATCH + 3
