"""Every way of leaving a request's scope: exactly one ABORT and one finished count, or none.

Leaving ``async with client.generate(...)`` before the terminal output -- ``break``, an
exception in the body, ``anyio.move_on_after`` around it, cancelling the task group that hosts
the consumer, or ``stream.cancel()`` -- must send the engine exactly one ABORT with the internal
id, record ``finished_reason`` once (``"abort"``, or ``"stop"`` under
``abort_cause(STOP_STRING_MATCHED)``), release the inflight tracking, and leak nothing.
Leaving the same ways after the terminal output sends no ABORT and counts the engine's reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from anyio_genout import AbortCause, Client, GenerateStream, abort_cause
from tests.engine.fake import FakeEngine

from .support import (
    LENGTH,
    finished_counts,
    generate_cluster,
    histogram_count,
    no_resource_warnings,
    output,
    request,
)

pytestmark = pytest.mark.anyio

#: How long to listen for a second (or any) ABORT: the abort worker sends within a few
#: event-loop iterations of the scope being left.
QUIET = 0.05


class Boom(Exception):
    pass


def cause_scope(cause: AbortCause | None) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if cause is None else abort_cause(cause)


async def send_first(stream: GenerateStream, engine: FakeEngine, terminal: bool) -> str:
    """Receive the ADD and have the engine send one output [99] (terminal if asked)."""
    internal = (await engine.receive_add()).request.request_id
    assert internal == stream.request_id
    await engine.send([output(internal, [99], LENGTH if terminal else None)])
    return internal


async def first_output(stream: GenerateStream, engine: FakeEngine, terminal: bool) -> str:
    """:func:`send_first`, then read that output."""
    internal = await send_first(stream, engine, terminal)
    out = await stream.__anext__()
    assert out.token_ids == [99]
    assert out.finished is terminal
    return internal


async def drain_then_wait(stream: GenerateStream) -> None:
    """Keep consuming (blocks while the request is live), then block forever."""
    async for _ in stream:
        pass  # pragma: no cover - nothing more is sent
    await anyio.sleep_forever()


async def leave_by_break(client: Client, engine: FakeEngine, cause: AbortCause | None,
                         terminal: bool) -> str:
    with cause_scope(cause):
        async with client.generate(request("req-exit")) as stream:
            internal = await send_first(stream, engine, terminal)
            async for out in stream:  # pragma: no branch
                assert out.token_ids == [99]
                break
    return internal


async def leave_by_exception(client: Client, engine: FakeEngine, cause: AbortCause | None,
                             terminal: bool) -> str:
    internal = ""
    with pytest.raises(Boom) as info, cause_scope(cause):
        async with client.generate(request("req-exit")) as stream:
            internal = await first_output(stream, engine, terminal)
            raise Boom("from the body")
    assert type(info.value) is Boom  # unchanged: not wrapped in an ExceptionGroup
    assert str(info.value) == "from the body"
    return internal


async def leave_by_move_on_after(client: Client, engine: FakeEngine, cause: AbortCause | None,
                                 terminal: bool) -> str:
    with cause_scope(cause), anyio.move_on_after(10) as scope:
        async with client.generate(request("req-exit")) as stream:
            internal = await first_output(stream, engine, terminal)
            scope.deadline = anyio.current_time() + 0.02
            await drain_then_wait(stream)
    assert scope.cancelled_caught
    return internal


async def leave_by_cancelling_the_task_group(client: Client, engine: FakeEngine,
                                             cause: AbortCause | None, terminal: bool) -> str:
    ids: list[str] = []
    got_first = anyio.Event()

    async def consumer() -> None:
        with cause_scope(cause):
            async with client.generate(request("req-exit")) as stream:
                ids.append(await first_output(stream, engine, terminal))
                got_first.set()
                await drain_then_wait(stream)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        await got_first.wait()
        tg.cancel_scope.cancel()
    return ids[0]


async def leave_by_stream_cancel(client: Client, engine: FakeEngine, cause: AbortCause | None,
                                 terminal: bool) -> str:
    with cause_scope(cause):
        async with client.generate(request("req-exit")) as stream:
            internal = await first_output(stream, engine, terminal)
            stream.cancel()
            assert [out async for out in stream] == []  # the iteration ends at once
    return internal


Leave = Callable[[Client, FakeEngine, "AbortCause | None", bool], Awaitable[str]]
EXITS: dict[str, Leave] = {
    "break": leave_by_break,
    "exception": leave_by_exception,
    "move_on_after": leave_by_move_on_after,
    "cancel_task_group": leave_by_cancelling_the_task_group,
    "stream_cancel": leave_by_stream_cancel,
}
CAUSES = {
    "dropped": (None, "abort"),
    "explicit_dropped": (AbortCause.DROPPED_STREAM, "abort"),
    "stop_string": (AbortCause.STOP_STRING_MATCHED, "stop"),
}


@pytest.mark.parametrize("cause_name", ["dropped", "stop_string"])
@pytest.mark.parametrize("how", list(EXITS))
async def test_leaving_early_aborts_exactly_once(how: str, cause_name: str) -> None:
    cause, reason = CAUSES[cause_name]
    with no_resource_warnings():
        async with generate_cluster() as (client, (engine,)):
            internal = await EXITS[how](client, engine, cause, False)
            assert AbortCause.current() is AbortCause.DROPPED_STREAM  # restored
            with anyio.fail_after(1):
                abort = await engine.receive_abort()
            assert abort.request_ids == (internal,)
            await engine.expect_nothing(QUIET)  # exactly one ABORT
            assert finished_counts(client) == {reason: 1}
            assert histogram_count(client, "vllm:e2e_request_latency_seconds") == 1
            assert len(client.inflight) == 0
            assert client.engine.in_flight == 0
            assert client.engine.aborts_sent == 1


@pytest.mark.parametrize("cause_name", ["dropped", "stop_string"])
@pytest.mark.parametrize("how", list(EXITS))
async def test_leaving_after_the_terminal_output_sends_no_abort(how: str,
                                                               cause_name: str) -> None:
    cause, _ = CAUSES[cause_name]
    with no_resource_warnings():
        async with generate_cluster() as (client, (engine,)):
            await EXITS[how](client, engine, cause, True)
            await engine.expect_nothing(QUIET)
            assert finished_counts(client) == {"length": 1}  # the engine's reason, once
            assert histogram_count(client, "vllm:e2e_request_latency_seconds") == 1
            assert len(client.inflight) == 0
            assert client.engine.aborts_sent == 0


async def test_explicit_dropped_stream_cause_counts_abort() -> None:
    cause, reason = CAUSES["explicit_dropped"]
    async with generate_cluster() as (client, (engine,)):
        internal = await leave_by_break(client, engine, cause, False)
        assert (await engine.receive_abort()).request_ids == (internal,)
        assert finished_counts(client) == {reason: 1}


async def test_abort_cause_is_per_task() -> None:
    seen: dict[str, AbortCause] = {}
    stop_set = anyio.Event()

    async def stopper() -> None:
        with abort_cause(AbortCause.STOP_STRING_MATCHED):
            stop_set.set()
            seen["stopper"] = AbortCause.current()
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(stopper)
        await stop_set.wait()
        seen["other"] = AbortCause.current()
    assert seen == {"stopper": AbortCause.STOP_STRING_MATCHED,
                    "other": AbortCause.DROPPED_STREAM}
    assert AbortCause.STOP_STRING_MATCHED.finished_reason == "stop"
    assert AbortCause.DROPPED_STREAM.finished_reason == "abort"


async def test_tasks_started_inside_abort_cause_inherit_it() -> None:
    """The cause is a context variable: a task started inside the ``with`` block copies it
    (asyncio and trio alike), and keeps it after the block ends; one started outside does
    not."""
    async with generate_cluster() as (client, (engine,)):
        left: dict[str, str] = {}

        async def leave_early(name: str, ready: anyio.Event) -> None:
            async with client.generate(request(name)) as stream:
                left[name] = stream.request_id
                await ready.wait()
            # (the scope is left here, before any output)

        inside_ready, outside_ready = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(leave_early, "outside", outside_ready)
            with abort_cause(AbortCause.STOP_STRING_MATCHED):
                tg.start_soon(leave_early, "inside", inside_ready)
            # Both children leave their scopes after the ``with`` block has ended.
            await anyio.wait_all_tasks_blocked()
            inside_ready.set()
            outside_ready.set()
        for _ in range(2):
            await engine.receive_add()
        aborted: list[str] = []
        with anyio.fail_after(1):
            while len(aborted) < 2:
                aborted.extend((await engine.receive_abort()).request_ids)
        assert sorted(aborted) == sorted(left.values())
        assert finished_counts(client) == {"stop": 1, "abort": 1}


async def test_many_streams_left_together_abort_each_once() -> None:
    async with generate_cluster() as (client, (engine,)):
        with anyio.move_on_after(0.05):
            async with client.generate(request("a")), client.generate(request("b")), \
                    client.generate(request("c")):
                await anyio.sleep_forever()
        adds = [(await engine.receive_add()).request.request_id for _ in range(3)]
        aborted: list[str] = []
        with anyio.fail_after(1):
            while len(aborted) < 3:
                aborted.extend((await engine.receive_abort()).request_ids)
        assert sorted(aborted) == sorted(adds)
        await engine.expect_nothing(QUIET)
        assert finished_counts(client) == {"abort": 3}
        assert len(client.inflight) == 0


@pytest.mark.parametrize("method", ["cancel", "close"])
async def test_stream_cancel_or_close_from_another_task_ends_a_waiting_iteration(
        method: str) -> None:
    """The consumer waits in ``async for``; a watchdog task gives up on the request: the
    request is aborted and the waiting consumer wakes, its loop ends, the block ends
    normally (``close()`` from another task used to leave the consumer parked forever)."""
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("req-watchdog")) as stream:
            internal = await first_output(stream, engine, False)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_give_up_soon, stream, method)
                with anyio.fail_after(5):
                    rest = [out async for out in stream]
        assert rest == []
        assert (await engine.receive_abort()).request_ids == (internal,)
        await engine.expect_nothing(QUIET)
        assert finished_counts(client) == {"abort": 1}
        assert len(client.inflight) == 0 and client.engine.in_flight == 0


async def _give_up_soon(stream: GenerateStream, method: str) -> None:
    await anyio.wait_all_tasks_blocked()  # the consumer is parked
    getattr(stream, method)()


async def test_a_stream_is_entered_once_and_only_iterated_inside_its_scope() -> None:
    async with generate_cluster() as (client, (engine,)):
        stream = client.generate(request("req-once"))
        with pytest.raises(RuntimeError, match="async with"):
            await stream.__anext__()
        with pytest.raises(RuntimeError, match="not been entered"):
            _ = stream.engine_index
        async with stream:
            internal = (await engine.receive_add()).request.request_id
            with pytest.raises(RuntimeError, match="only once"):
                async with stream:
                    pass  # pragma: no cover
            await engine.send([output(internal, [], LENGTH)])
            assert [o.finish_reason async for o in stream] != []
        await engine.expect_nothing(0.05)
