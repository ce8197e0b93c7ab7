"""The checkpoint policy (issue 23 item 3): a busy consumer's turn ends by time, and at its
cancel scope's deadline, not after a fixed number of buffered outputs.

The fake engine buffers many outputs at once; the consumer spends 1 ms of blocking work on
each. Before, the stream yielded once every 32 buffered outputs: a 10 ms timeout around it
fired after 32 outputs (more than 32 ms), and another task waited as long for its turn.
The bounds are counted in outputs, not milliseconds: a loaded machine that stalls the whole
process for a while (CI) changes the times, not how many outputs a turn takes.
The streams are per step (``per_step=True``): the policy counts outputs, and coalesced the
buffered steps would come as a few large outputs."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from anyio_genout.engine.pace import HOLD
from anyio_genout.protocol import EngineCoreFinishReason, EngineCoreOutputs, encode_outputs

from .support import generate_cluster, output, request

pytestmark = pytest.mark.anyio

WORK = 0.001  # seconds of blocking work per output


class _Ticker:
    """Counts the loop passes it gets (a checkpoint each) until ``done`` is set."""

    def __init__(self) -> None:
        self.ticks = 0
        self.done = anyio.Event()

    async def run(self) -> None:
        while not self.done.is_set():
            await anyio.lowlevel.checkpoint()
            self.ticks += 1


async def test_a_timeout_around_a_busy_consumer_fires_within_an_output_or_two() -> None:
    async with generate_cluster() as (client, (engine,)):
        taken_at: list[float] = []
        with anyio.move_on_after(0.01) as scope:
            async with client.generate(request("busy", max_tokens=None),
                                       per_step=True) as stream:
                internal = (await engine.receive_add()).request.request_id
                await engine.send([output(internal, [7]) for _ in range(200)])
                async for out in stream:
                    assert len(out.token_ids) == 1
                    taken_at.append(anyio.current_time())
                    time.sleep(WORK)  # noqa: ASYNC251 - a busy consumer's own work
        assert scope.cancelled_caught
        assert len(taken_at) <= 20, f"{len(taken_at)} outputs taken in a 10 ms scope at 1 ms each"
        late = sum(1 for t in taken_at if t >= scope.deadline)
        assert late <= 2, f"{late} outputs taken after the deadline"


async def test_a_busy_consumer_leaves_the_loop_to_others_every_turn() -> None:
    async with generate_cluster() as (client, (engine,)):
        ticker = _Ticker()
        ticks_at_output: list[int] = []  # the ticker's count when each output came

        async with anyio.create_task_group() as tg, \
                client.generate(request("hog", max_tokens=None), per_step=True) as stream:
            internal = (await engine.receive_add()).request.request_id
            # The last output ends the stream, so a slow machine that gives the ticker fewer
            # turns fails the count below instead of waiting forever for more outputs.
            await engine.send([output(internal, [7]) for _ in range(100)]
                              + [output(internal, [7], EngineCoreFinishReason.LENGTH)])
            tg.start_soon(ticker.run)
            async for out in stream:
                ticks_at_output.append(ticker.ticks)
                time.sleep(WORK)  # noqa: ASYNC251 - a busy consumer's own work
                if out.token_ids and ticker.ticks > 40:
                    break
            ticker.done.set()
        assert ticker.ticks > 40, f"the ticker ran {ticker.ticks} times over 100 busy outputs"
        # One turn is the 1 ms slice plus the output that used it up: the ticker runs between
        # every two outputs (after its start).
        started = ticks_at_output.index(next(t for t in ticks_at_output if t > 0))
        seen = ticks_at_output[started:]
        starved = [i for i in range(len(seen) - 2) if seen[i + 2] == seen[i]]
        assert not starved, f"the ticker did not run over outputs {starved[0]}..{starved[0] + 2}"


async def test_consumers_woken_past_their_deadline_leave_before_taking_an_output() -> None:
    """Twelve parked consumers woken in one loop pass, each with 5 ms of work per output, and
    a deadline that passes during that pass: one woken past its deadline leaves without
    taking its output (before, each took it and worked first, so the pass ran on for all
    twelve and the last left about 50 ms late; asyncio runs due timers after the tasks
    already queued, so the stream itself has to yield to let the cancellation in)."""
    late = await _outputs_taken_past_the_deadline()
    assert not late, f"outputs taken this many ms after their deadline: {late}"


class _CoarseClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock, like uvloop's, trails the stream's (``perf_counter``): it
    moves in steps, here of 4 ms (libuv's is whole milliseconds read from the kernel's coarse
    clock), so a scope's timer fires up to a step after its deadline has passed by the
    stream's clock."""

    def time(self) -> float:
        return math.floor(super().time() / 0.004) * 0.004


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"loop_factory": _CoarseClockLoop})])
async def test_consumers_past_their_deadline_wait_for_a_loop_clock_that_trails() -> None:
    """The loop's clock trails the stream's: a consumer that finds itself past its deadline
    waits until the loop's clock has passed it too, so the cancellation comes before it
    takes an output (before, its two quick yields both came back before the scope's timer
    fired: a uvloop CI run took nine outputs 5-48 ms past the deadline, one after another)."""
    late = await _outputs_taken_past_the_deadline()
    assert not late, f"outputs taken this many ms after their deadline: {late}"


async def _outputs_taken_past_the_deadline() -> list[float]:
    """Twelve parked consumers, woken in one loop pass with 5 ms of work per output, and a
    deadline 12 ms away for all: how many ms after it each output taken late was taken
    (2 ms of slack)."""
    streams, work = 12, 0.005
    async with generate_cluster() as (client, (engine,)):
        taken: list[tuple[float, float]] = []  # (when, that consumer's deadline)
        cancelled = 0
        entered = anyio.Event()
        deadline = anyio.current_time() + 10.0  # set for every scope once all are parked
        scopes: list[anyio.CancelScope] = []

        async def consume(n: int) -> None:
            nonlocal cancelled
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                async with client.generate(request(f"woken-{n}", max_tokens=None),
                                           per_step=True) as stream:
                    if len(scopes) == streams:
                        entered.set()
                    async for _out in stream:
                        taken.append((time.perf_counter(), deadline_perf))
                        time.sleep(work)  # noqa: ASYNC251 - a busy consumer's own work
            cancelled += scope.cancelled_caught

        async with anyio.create_task_group() as tg:
            for n in range(streams):
                tg.start_soon(consume, n)
            await entered.wait()
            internal = [(await engine.receive_add()).request.request_id for _ in range(streams)]
            await anyio.sleep(0.03)  # parked a while: the loop counts as congested for them
            # Queue the outputs first and hold the loop while ZeroMQ moves them, so the
            # reader finds them there at its next look however loaded the machine: the
            # deadline then runs from a moment the consumers are a loop pass or two from
            # waking, not from before a delivery that may itself take longer than 12 ms.
            assert engine.output.send_nowait(encode_outputs(EngineCoreOutputs(
                engine_index=0, outputs=[output(rid, [7]) for rid in internal])))
            time.sleep(0.02)  # noqa: ASYNC251 - the point is that no task runs meanwhile
            deadline = anyio.current_time() + 0.012
            # The deadline on the stream's clock (the loop's may trail it).
            deadline_perf = time.perf_counter() + (deadline - anyio.current_time())
            for scope in scopes:
                scope.deadline = deadline
        assert cancelled == streams
        assert len(taken) >= 1, "no consumer took an output before the deadline"
        return [round((when - limit) * 1e3, 1) for when, limit in taken if when > limit + 0.002]


async def _passes_per_message(client: Any, engine: Any, *, leave: bool) -> list[int] | None:
    """Queue 32 one-output messages for a stream at once; the ticker's count at each output
    the stream gives (per step). With ``leave``, another stream is closed early just before
    the reader looks: it then hands over one message a loop pass. None if the machine
    stalled past the reader's hold (pace.HOLD) meanwhile, so the attempt says nothing."""
    ticker = _Ticker()
    seen: list[int] = []
    async with anyio.create_task_group() as tg, \
            client.generate(request("kept", max_tokens=None), per_step=True) as kept, \
            client.generate(request("left", max_tokens=None)) as left:
        internal = (await engine.receive_add()).request.request_id
        other = (await engine.receive_add()).request.request_id
        if internal.startswith("left"):
            internal = other
        tg.start_soon(ticker.run)
        for _ in range(32):
            assert engine.output.send_nowait(encode_outputs(EngineCoreOutputs(
                engine_index=0, outputs=[output(internal, [7])])))
        # Hold the loop while ZeroMQ moves every message, so the reader finds them all
        # queued when it looks, however loaded the machine.
        time.sleep(0.02)  # noqa: ASYNC251 - the point is that no task runs meanwhile
        started = time.perf_counter()
        if leave:
            left.close()  # left before its end: the reader's pace (pace.py)
        async for _out in kept:
            seen.append(ticker.ticks)
            if len(seen) == 32:
                break
        elapsed = time.perf_counter() - started
        ticker.done.set()
    # Both streams were left early: take their ABORTs (one frame or two), so that the next
    # attempt's ADDs are the next thing the engine reads.
    aborted: set[str] = set()
    while len(aborted) < 2:
        aborted.update((await engine.receive_abort()).request_ids)
    return seen if elapsed < HOLD / 2 else None


@pytest.mark.parametrize("leave", [False, True], ids=["none-left", "one-left"])
async def test_while_a_consumer_leaves_the_reader_hands_over_one_message_a_pass(
        leave: bool) -> None:
    """A stream left before its end (the same holds for a consumer resumed past its
    deadline) paces the reader for a moment: each queued message comes in its own loop
    pass, so the leaving consumers' exits are not queued behind a batch of ``READ_BATCH`` messages
    (docs/lifecycle.md, "While consumers leave"). Without one, the reader hands over the
    messages queued in a batch, and the consumer takes several in one pass."""
    async with generate_cluster() as (client, (engine,)):
        longest: list[int] = []  # of each attempt the machine did not stall
        for _attempt in range(6):
            seen = await _passes_per_message(client, engine, leave=leave)
            if seen is None:
                continue
            # The longest run of outputs the consumer took in one pass. A message handed
            # over in a pass of its own may still share the consumer's next turn with the
            # one after it (trio runs a batch in either order, so the reader can come
            # first, and the ticker last): three at most.
            longest.append(max(len(list(group)) for _tick, group in itertools.groupby(seen)))
            if len(longest) == 2 or (not leave and longest[-1] >= 8):
                break
        if not longest:
            pytest.skip("the machine stalled past the reader's hold in every attempt")
        if leave:
            assert max(longest) <= 3, f"outputs taken in one pass, at most: {longest}"
        else:  # a batch whenever the messages were all there when the reader looked
            assert max(longest) >= 8, f"outputs taken in one pass, at most: {longest}"
