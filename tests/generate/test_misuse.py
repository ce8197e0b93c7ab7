"""Misuse gets a clear error at once, never a hang or a corrupted cancel scope.

* Two tasks iterating one stream: the second one to wait gets ``anyio.BusyResourceError`` at
  once, the first keeps reading, and cancelling either never strands the other.
* The natural async-generator wrapper (``async with client.generate(r) as s: async for o in
  s: yield o``) may be broken out of inside ``fail_after``, or closed from another task: the
  request scope spans no cancel scope, so the caller's scopes stay intact and the request
  is still aborted once.
* With ``randomize_request_ids=False``, an id whose request was aborted while the engine ran
  it is refused until a later request on that engine has produced output (which proves the
  engine's late outputs for the old request were all read and dropped).
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator
from contextlib import aclosing

import anyio
import pytest

from anyio_genout import (
    Client,
    DuplicateRequestIdError,
    FinishReason,
    GenerateOutput,
    GenerateStream,
)
from tests.engine.fake import FakeEngine

from .support import LENGTH, finished_counts, generate_cluster, output, request

pytestmark = pytest.mark.anyio

QUIET = 0.05


async def _read_all(stream: GenerateStream, got: list[list[int]]) -> None:
    async for out in stream:
        got.append(list(out.token_ids))


# ---------------------------------------------------------------------- two readers


async def test_a_second_task_iterating_a_stream_gets_busy_resource_error_at_once() -> None:
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("req-two-readers")) as stream:
            internal = (await engine.receive_add()).request.request_id
            got: list[list[int]] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(_read_all, stream, got)  # reader A waits for the first output
                await anyio.wait_all_tasks_blocked()
                with anyio.fail_after(1), pytest.raises(anyio.BusyResourceError) as info:
                    await stream.__anext__()  # reader B (this task)
                assert "another task is already iterating" in str(info.value)
                assert repr(internal) in str(info.value)
                await engine.send([output(internal, [1])])
                await engine.send([output(internal, [2], LENGTH)])
            # A kept its place and read everything; the stream ended normally.
            assert [t for out in got for t in out] == [1, 2]
            assert [out async for out in stream] == []
        await engine.expect_nothing(QUIET)
        assert finished_counts(client) == {"length": 1}


async def test_cancelling_one_reader_never_hangs_the_other() -> None:
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("req-cancel-reader")) as stream:
            internal = (await engine.receive_add()).request.request_id
            got: list[list[int]] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(_read_all, stream, [])  # reader A
                await anyio.wait_all_tasks_blocked()
                with anyio.fail_after(1), pytest.raises(anyio.BusyResourceError):
                    await stream.__anext__()  # reader B is refused...
                tg.cancel_scope.cancel()  # ...then A is cancelled while it waits
            with anyio.fail_after(5):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_read_all, stream, got)  # B again: now the only reader
                    await anyio.wait_all_tasks_blocked()
                    await engine.send([output(internal, [1])])
                    await engine.send([output(internal, [2], LENGTH)])
            assert [t for out in got for t in out] == [1, 2]
        await engine.expect_nothing(QUIET)


# ---------------------------------------------------------------------- generator wrappers


def _outputs(client: Client, request_id: str) -> AsyncIterator[GenerateOutput]:
    async def outputs() -> AsyncIterator[GenerateOutput]:
        async with client.generate(request(request_id, max_tokens=None)) as stream:
            async for out in stream:
                yield out

    return outputs()


async def _send_first(engine: FakeEngine) -> str:
    internal = (await engine.receive_add()).request.request_id
    await engine.send([output(internal, [7])])
    return internal


async def test_breaking_out_of_a_wrapping_async_generator_inside_fail_after(
        anyio_backend: tuple[str, dict[str, object]]) -> None:
    """The generator is left suspended inside the request's ``async with``; leaving the
    caller's ``fail_after`` must not trip over a cancel scope it left open, and the request
    is aborted when the generator is finalized (by the event loop, in another task)."""
    async with generate_cluster() as (client, (engine,)):
        async with anyio.create_task_group() as tg:
            internal = ""

            async def engine_side() -> None:
                nonlocal internal
                internal = await _send_first(engine)

            tg.start_soon(engine_side)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with anyio.fail_after(5):
                    async for out in _outputs(client, "req-gen"):
                        assert out.token_ids == [7]
                        break
        if anyio_backend[0] == "trio":  # trio says so of every generator it must finalize
            assert [w.category for w in caught] == [ResourceWarning]
            assert "aclosing" in str(caught[0].message)
        else:
            assert caught == []
        # The caller's own scopes still work, and the engine is told to stop, once.
        with anyio.fail_after(5):
            abort = await engine.receive_abort()
        assert abort.request_ids == (internal,)
        await engine.expect_nothing(QUIET)
        assert finished_counts(client) == {"abort": 1}
        assert client.engine.in_flight == 0 and len(client.inflight) == 0


async def test_a_wrapping_async_generator_closed_from_another_task() -> None:
    async with generate_cluster() as (client, (engine,)):
        gen = _outputs(client, "req-gen-other-task")
        async with anyio.create_task_group() as tg:
            tg.start_soon(_send_first, engine)
            with anyio.fail_after(5):
                first = await gen.__anext__()
        assert first.token_ids == [7]
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.aclose)  # the request's scope is left in that task
        with anyio.fail_after(5):
            await engine.receive_abort()
        assert finished_counts(client) == {"abort": 1}
        assert client.engine.in_flight == 0


async def test_aclosing_a_wrapping_async_generator_aborts_before_the_block_ends() -> None:
    async with generate_cluster() as (client, (engine,)):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_send_first, engine)
            with anyio.fail_after(5):
                async with aclosing(_outputs(client, "req-aclosing")) as outs:
                    async for _ in outs:
                        break
                # Closed in this task, at the end of the block: the request is aborted.
                assert client.engine.in_flight == 0
        with anyio.fail_after(5):
            await engine.receive_abort()


# ---------------------------------------------------------------------- id reuse


async def _leave_early(client: Client, engine: FakeEngine, request_id: str, how: str) -> None:
    """Run ``request_id`` and end it on the client while the engine still runs it."""
    params = {"stop_token_sequences": [(5, 6)]} if how == "stop_sequence" else {}
    async with client.generate(request(request_id, **params)) as stream:
        assert (await engine.receive_add()).request.request_id == request_id
        await engine.send([output(request_id, [5, 6] if how == "stop_sequence" else [1])])
        first = await stream.__anext__()
        if how == "stop_sequence":
            assert first.finished  # matched on the client: the engine still runs it
        elif how == "client_abort":
            await client.abort([request_id])
            rest = [out async for out in stream]
            assert [out.finish_reason for out in rest] == [FinishReason.ABORT]
    # "break": the block is left here, before the terminal output.
    assert (await engine.receive_abort()).request_ids == (request_id,)


async def _refused(client: Client, request_id: str) -> None:
    with pytest.raises(DuplicateRequestIdError, match=f"{request_id!r} was aborted") as info:
        async with client.generate(request(request_id)):
            pytest.fail("the id was reused")  # pragma: no cover
    assert info.value.request_id == request_id
    assert "randomize_request_ids=False" in str(info.value)


async def _run(client: Client, engine: FakeEngine, request_id: str,
               tokens: list[int]) -> list[list[int]]:
    """Run ``request_id`` to its end with one output, ``tokens``; what the stream yielded."""
    async with client.generate(request(request_id)) as stream:
        assert (await engine.receive_add()).request.request_id == request_id
        await engine.send([output(request_id, tokens, LENGTH)])
        return [list(out.token_ids) async for out in stream]


@pytest.mark.parametrize("how", ["break", "stop_sequence", "client_abort"])
async def test_an_aborted_id_is_refused_until_a_later_request_on_its_engine_has_output(
        how: str) -> None:
    async with generate_cluster(randomize_request_ids=False) as (client, (engine,)):
        await _leave_early(client, engine, "r1", how)
        await _refused(client, "r1")
        # The engine had made one more output for the old request before it read the ABORT:
        # it arrives now, and no stream may take it.
        await engine.send([output("r1", [66, 66])])
        async with client.generate(request("later")) as later:
            assert (await engine.receive_add()).request.request_id == "later"
            await _refused(client, "r1")  # "later" has produced nothing yet
            await engine.send([output("later", [2], LENGTH)])
            assert [list(out.token_ids) async for out in later] == [[2]]
        # "later" was sent after the ABORT, and its output came after the late one: reusable.
        assert await _run(client, engine, "r1", [3]) == [[3]]
        assert len(client.inflight.aborted) == 0


async def test_a_request_sent_before_the_abort_left_proves_nothing() -> None:
    """The abort worker sends the ABORT a moment after the scope is left: a request whose
    ADD went out before it may have output while the engine still runs the old one."""
    async with generate_cluster(randomize_request_ids=False) as (client, (engine,)):
        async with client.generate(request("r1")) as stream:
            await engine.receive_add()
            await engine.send([output("r1", [1])])
            await stream.__anext__()
        # No checkpoint since the scope was left: r1's ABORT is still queued behind this ADD.
        async with client.generate(request("early")) as early:
            assert (await engine.receive_add()).request.request_id == "early"
            assert (await engine.receive_abort()).request_ids == ("r1",)
            await engine.send([output("early", [2], LENGTH)])
            assert [list(out.token_ids) async for out in early] == [[2]]
        await _refused(client, "r1")
        assert await _run(client, engine, "after", [4]) == [[4]]
        assert await _run(client, engine, "r1", [3]) == [[3]]


async def test_only_output_from_the_aborted_requests_engine_lifts_the_refusal() -> None:
    async with generate_cluster(2, randomize_request_ids=False) as (client, engines):
        async with client.generate(request("r1", data_parallel_rank=0)) as stream:
            await engines[0].receive_add()
            await engines[0].send([output("r1", [1])])
            await stream.__anext__()
        assert (await engines[0].receive_abort()).request_ids == ("r1",)
        async with client.generate(request("elsewhere", data_parallel_rank=1)) as other:
            await engines[1].receive_add()
            await engines[1].send([output("elsewhere", [2], LENGTH)])
            assert [list(out.token_ids) async for out in other] == [[2]]
        await _refused(client, "r1")


async def test_an_id_is_reusable_at_once_after_the_engine_finished_it() -> None:
    async with generate_cluster(randomize_request_ids=False) as (client, (engine,)):
        assert await _run(client, engine, "r1", [1]) == [[1]]
        assert await _run(client, engine, "r1", [2]) == [[2]]
        await engine.expect_nothing(QUIET)


async def test_random_internal_ids_are_never_refused() -> None:
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("r1")) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(internal, [1])])
            await stream.__anext__()
        async with client.generate(request("r1")) as again:
            assert again.request_id != internal
        assert len(client.inflight.aborted) == 0
