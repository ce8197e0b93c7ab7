"""GenerateStream's life as one phase and a transition table (generate/state.py).

Every (phase, event) pair of the table: the legal ones lead where the diagram says, the
illegal ones raise StreamStateError naming the phase. Then, through a real client over a
fake engine on every backend, the phases a user walks a stream through and the misuses the
table refuses (reading before entering, entering twice), with the message naming the phase.
"""

from __future__ import annotations

import itertools

import anyio
import numpy as np
import pytest

from anyio_genout.generate.state import (
    TRANSITIONS,
    Event,
    Phase,
    StreamStateError,
    transition,
)
from anyio_genout.generate.stop_sequences import cut_at_stop
from anyio_genout.protocol import Logprobs

from .support import LENGTH, generate_cluster, output, request

P, E = Phase, Event
#: The table as the module docstring draws it; every pair not here is illegal.
LEGAL = {
    (P.IDLE, E.ENTER): P.FIRST, (P.IDLE, E.CLOSE): P.IDLE,
    **{(p, E.RECEIVE): p for p in Phase if p is not P.IDLE},
    **{(p, E.CLOSE): P.CLOSED for p in Phase if p is not P.IDLE},
    **{(p, E.OUTPUT): P.STREAMING for p in (P.FIRST, P.CONTINUING, P.STREAMING)},
    **{(p, E.TERMINAL): P.FINISHED for p in (P.FIRST, P.CONTINUING, P.STREAMING)},
    **{(p, E.ERROR): P.ENDED for p in (P.FIRST, P.CONTINUING, P.STREAMING)},
    (P.CLOSED, E.ERROR): P.CLOSED,
    (P.FIRST, E.MOVE): P.FIRST, (P.CONTINUING, E.MOVE): P.CONTINUING,
    (P.STREAMING, E.MOVE): P.CONTINUING,
    (P.FINISHED, E.RECORD): P.ENDED,
}


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)),
                         ids=lambda v: v.label)
def test_every_transition(phase: Phase, event: Event) -> None:
    expected = LEGAL.get((phase, event))
    assert TRANSITIONS[phase][event] == expected
    if expected is not None:
        assert transition(phase, event) is expected
        return
    with pytest.raises(StreamStateError, match=f"in state {phase.label}") as caught:
        transition(phase, event)
    assert (caught.value.phase, caught.value.event) == (phase, event)
    assert isinstance(caught.value, RuntimeError)  # what misuse raised before


pytestmark_anyio = pytest.mark.anyio


@pytestmark_anyio
async def test_a_stream_walks_its_phases_and_refuses_misuse() -> None:
    async with generate_cluster() as (client, (engine,)):
        stream = client.generate(request("phases"))
        assert stream.phase is Phase.IDLE
        with pytest.raises(StreamStateError, match=r"receive is not allowed in state idle"
                                                   r".*async with"):
            await stream.__anext__()
        with pytest.raises(StreamStateError, match="state idle"):
            stream.receive_buffered()
        async with stream:
            assert stream.phase is Phase.FIRST
            with pytest.raises(StreamStateError, match=r"enter is not allowed in state first"
                                                       r".*only once"):
                async with stream:
                    pass  # pragma: no cover
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(internal, [5])])
            first = await stream.__anext__()
            assert first.prompt_token_ids == (11, 22) and stream.phase is Phase.STREAMING
            await engine.send([output(internal, [6, 7], LENGTH)])
            last = await stream.__anext__()
            assert last.token_ids == [6, 7] and stream.phase is Phase.FINISHED
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            assert stream.phase is Phase.ENDED
            with pytest.raises(StopAsyncIteration):  # the end stays the end
                await stream.receive()
        assert stream.phase is Phase.CLOSED
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await engine.expect_nothing(0.05)  # no ABORT: it had finished


@pytestmark_anyio
async def test_close_mid_stream_ends_every_receive_path() -> None:
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("closing", max_tokens=None)) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(internal, [5])])
            assert (await stream.__anext__()).token_ids == [5]
            stream.close()
            assert stream.phase is Phase.CLOSED
            assert stream.receive_buffered() is None
            for receive in (stream.__anext__, stream.receive):
                with pytest.raises(StopAsyncIteration):
                    await receive()
            assert (await engine.receive_abort()).request_ids == (internal,)
        assert stream.phase is Phase.CLOSED


@pytestmark_anyio
async def test_a_wait_in_another_task_ends_when_the_stream_is_closed() -> None:
    async with generate_cluster() as (client, (engine,)), \
            client.generate(request("waiting")) as stream:
            await engine.receive_add()
            ended = anyio.Event()

            async def consume() -> None:
                with pytest.raises(StopAsyncIteration):
                    await stream.__anext__()
                ended.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await anyio.wait_all_tasks_blocked()
                assert stream.phase is Phase.FIRST
                stream.cancel()
            assert ended.is_set() and stream.phase is Phase.CLOSED


class _Closed:
    def __init__(self) -> None:
        self.causes: list[object] = []

    def close(self, cause: object = None) -> None:
        self.causes.append(cause)


def test_the_stop_cut_keeps_the_matched_part_and_closes_once() -> None:
    from anyio_genout import AbortCause, FinishReason

    target = _Closed()
    rows = Logprobs(np.array([[7], [8], [9]]), np.array([[-0.1], [-0.2], [-0.3]]),
                    np.array([1, 1, 1]))
    tokens, logprobs, mask, finish = cut_at_stop(target, 2, (7, 8), [7, 8, 9], rows)
    assert tokens == [7, 8] and mask is None
    assert logprobs is not None and logprobs.token_ids.tolist() == [[7], [8]]
    assert finish == FinishReason.stop((7, 8))
    assert target.causes == [AbortCause.STOP_STRING_MATCHED]
    whole = [1, 2]
    kept, *_ = cut_at_stop(target, 2, "x", whole)
    assert kept is whole  # nothing to cut: the same list
