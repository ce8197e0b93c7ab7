"""Conformance of EngineCoreClient against a scripted fake engine (both backends)."""

from __future__ import annotations

import random

import anyio
import numpy as np
import pytest

from anyio_genout import (
    BootstrappedTransport,
    ClientClosedError,
    DuplicateRequestIdError,
    EngineCoreClient,
    EngineCoreClientConfig,
    EngineCoreRequest,
    EngineDeadError,
    HandshakeError,
    HandshakeTimeoutError,
    HandshakeTransport,
    InconsistentUtilityResultsError,
    InvalidRequestError,
    ProtocolError,
    RequestStreamClosedError,
    SamplingParams,
    UnsupportedVersionError,
    UtilityCallError,
)
from anyio_genout.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreFinishReason,
    EngineCoreOutput,
    SchedulerStats,
)
from anyio_genout.protocol.arrays import encode_array
from tests.support import wait_until

from .fake import Cluster, FakeEngine, free_port

pytestmark = pytest.mark.anyio

LENGTH = EngineCoreFinishReason.LENGTH


def req(rid: str, **kw: object) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[11, 22],
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=8),
                             arrival_time=42.5, **kw)  # type: ignore[arg-type]


def out(rid: str, tokens: list[int], finish: EngineCoreFinishReason | None = None
        ) -> EngineCoreOutput:
    return EngineCoreOutput(rid, tokens, finish_reason=finish)


async def test_streams_outputs_and_stamps_client_index() -> None:
    async with Cluster(client_index=7) as (client, (engine,)):
        assert client.engine_ranks == [0]
        assert client.engine_identities == [b"\x00\x00"]
        assert client.max_model_len == 4096
        assert client.vllm_version == "0.32.0"
        async with client.call(req("req-1")) as stream:
            add = await engine.receive_add()
            assert add.request.request_id == "req-1"
            assert add.request.client_index == 7
            assert add.request.prompt_token_ids == (11, 22)
            await engine.send([out("req-1", [1, 2])], timestamp=3.5)
            await engine.send([out("other", [5]), out("req-1", [3], LENGTH)])
            items = [item async for item in stream]
        assert [i.output.new_token_ids for i in items] == [[1, 2], [3]]
        # A plain output is buffered as its decoded row; a stream gives the output.
        assert all(type(i.output) is EngineCoreOutput for i in items)
        assert items[0].timestamp == 3.5 and items[0].engine_index == 0
        assert items[-1].output.finish_reason is LENGTH
        assert client.in_flight == 0
        task = anyio.create_task_group()
        async with task:
            task.start_soon(client.is_sleeping)
            call = await engine.receive_utility()
            assert (call.client_index, call.method, call.args) == (7, "is_sleeping", ())
            await engine.reply(call, True)
        await engine.expect_nothing(0.1)  # a finished request is not aborted


async def test_buffered_outputs_read_without_waiting_keep_their_own_timestamps() -> None:
    """receive_output_nowait gives each output with the timestamp of the message that
    carried it (in ``stream.timestamp``), however many are buffered, and nothing once ended."""
    async with Cluster() as (client, (engine,)), client.call(req("req-1")) as stream:
        await engine.receive_add()
        assert stream.receive_output_nowait() is None
        for step in range(3):
            await engine.send([out("req-1", [step])], timestamp=10.0 + step)
        await wait_until(lambda: len(stream._box.items) == 6)
        got = []
        assert type(stream.peek_output()) is EngineCoreOutput
        while (output := stream.receive_output_nowait()) is not None:
            assert type(output) is EngineCoreOutput
            got.append((output.new_token_ids, stream.timestamp))
        assert got == [([0], 10.0), ([1], 11.0), ([2], 12.0)]
        await engine.send([out("req-1", [3])], timestamp=13.0)
        item = await stream.__anext__()
        assert (item.output.new_token_ids, item.timestamp, stream.timestamp) == ([3], 13.0,
                                                                                 13.0)
        await engine.send([out("req-1", [4], LENGTH)], timestamp=14.0)
        await wait_until(lambda: stream.terminated or len(stream._box.items) == 2)
        final = stream.receive_nowait()
        assert final is not None and final.output.finish_reason is LENGTH
        assert final.timestamp == 14.0 and stream.terminated
        with pytest.raises(anyio.EndOfStream):  # ended: nothing more, and not "empty"
            stream.receive_output_nowait()


async def test_nowait_tells_an_ended_stream_from_an_empty_one() -> None:
    """None means "nothing buffered yet"; a stream that ended (terminal output delivered,
    or closed) raises EndOfStream, so a polling consumer never waits forever on it."""
    async with Cluster() as (client, (engine,)):
        async with client.call(req("done")) as stream:
            await engine.receive_add()
            assert stream.receive_nowait() is None  # empty: try again later
            await engine.send([out("done", [1], LENGTH)])
            assert (await stream.__anext__()).output.finish_reason is LENGTH
            with pytest.raises(anyio.EndOfStream):
                stream.receive_nowait()
        async with client.call(req("left")) as stream:
            await engine.receive_add()
            assert stream.receive_output_nowait() is None
            stream.close()
            with pytest.raises(anyio.EndOfStream):
                stream.receive_output_nowait()
            with pytest.raises(anyio.EndOfStream):
                stream.receive_nowait()


async def test_duplicate_request_id_is_refused_without_sending() -> None:
    async with Cluster() as (client, (engine,)), client.call(req("req-1")) as stream:
        await engine.receive_add()
        with pytest.raises(DuplicateRequestIdError):
            async with client.call(req("req-1")):
                pass
        await engine.expect_nothing(0.2)
        await engine.send([out("req-1", [], LENGTH)])
        assert [i.output.finish_reason async for i in stream] == [LENGTH]


async def test_finished_requests_without_final_output_is_unexpected_close() -> None:
    async with Cluster() as (client, (engine,)):
        async with client.call(req("req-1")) as stream:
            await engine.receive_add()
            await engine.send([], finished_requests=frozenset({"req-1"}))
            with pytest.raises(RequestStreamClosedError) as info:
                await stream.__anext__()
            assert info.value.request_id == "req-1"
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
        await engine.expect_nothing(0.2)  # no ABORT for a request the engine already dropped


async def test_dropping_a_live_stream_aborts_it() -> None:
    async with Cluster() as (client, (engine,)):
        async with client.call(req("req-1")) as stream:
            await engine.receive_add()
            await engine.send([out("req-1", [99])])
            async for item in stream:
                assert item.output.new_token_ids == [99]
                break
        with anyio.fail_after(1):
            abort = await engine.receive_abort()
        assert abort.request_ids == ("req-1",)
        assert client.in_flight == 0
        await engine.expect_nothing(0.1)


async def test_dropping_three_streams_together_aborts_all_three() -> None:
    async with Cluster() as (client, (engine,)):
        with anyio.move_on_after(0.1):
            async with client.call(req("req-1")), client.call(req("req-2")), \
                    client.call(req("req-3")):
                await anyio.sleep_forever()
        adds = {(await engine.receive_add()).request.request_id for _ in range(3)}
        assert adds == {"req-1", "req-2", "req-3"}
        aborted: list[str] = []
        with anyio.fail_after(1):
            while len(aborted) < 3:
                aborted.extend((await engine.receive_abort()).request_ids)
        assert sorted(aborted) == ["req-1", "req-2", "req-3"]
        await engine.expect_nothing(0.1)


async def test_invalid_msgpack_poisons_streams_and_later_calls() -> None:
    async with Cluster() as (client, (engine,)):
        async with client.call(req("req-1")) as s1, client.call(req("req-2")) as s2:
            await engine.receive_add()
            await engine.receive_add()
            await engine.send_raw([b"\xc1"])
            for stream in (s1, s2):
                with pytest.raises(ProtocolError):
                    await stream.__anext__()
        assert not client.is_healthy
        assert isinstance(client.health_error, ProtocolError)
        with pytest.raises(ProtocolError):
            await client.abort(["req-1"])
        with pytest.raises(ProtocolError):
            async with client.call(req("req-3")):
                pass


async def test_multipart_garbage_marks_unhealthy_with_first_error() -> None:
    async with Cluster() as (client, (engine,)):
        await engine.send_raw([b"frame-1", b"frame-2"])
        with anyio.fail_after(2):
            await wait_until(lambda: not client.is_healthy)
        assert isinstance(client.health_error, ProtocolError)
        await engine.send_raw([ENGINE_CORE_DEAD])
        await anyio.sleep(0.05)
        assert isinstance(client.health_error, ProtocolError)  # the first error sticks


async def test_engine_core_dead_sticks_and_fails_waiting_utility_calls() -> None:
    async with Cluster() as (client, (engine,)):
        async with anyio.create_task_group() as tg:
            async def call() -> None:
                with pytest.raises(EngineDeadError):
                    await client.get_supported_tasks()
            tg.start_soon(call)
            await engine.receive_utility()
            assert client.pending_utility_calls == 1
            await engine.send_raw([ENGINE_CORE_DEAD])
        assert isinstance(client.health_error, EngineDeadError)
        assert client.pending_utility_calls == 0
        with pytest.raises(EngineDeadError):
            await client.is_sleeping()
        assert isinstance(client.health_error, EngineDeadError)


async def test_dp_control_on_the_main_output_socket_is_fatal() -> None:
    async with Cluster() as (client, (engine,)):
        async with client.call(req("req-1")) as stream:
            await engine.receive_add()
            await engine.send([], start_wave=3)
            with pytest.raises(ProtocolError, match="wave control"):
                await stream.__anext__()
        assert isinstance(client.health_error, ProtocolError)


async def test_reply_for_an_unknown_utility_call_is_ignored() -> None:
    async with Cluster() as (client, (engine,)):
        await engine.send(utility_output=__import__("anyio_genout").protocol.UtilityOutput(12345))
        await anyio.sleep(0.05)
        assert client.is_healthy


async def test_handshake_timeout_names_ready_stage() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = FakeEngine()
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), ready_timeout=0.3)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: engine.handshake(address, send_ready=False))
            with pytest.raises(HandshakeTimeoutError, match="READY") as info:
                async with EngineCoreClient.connect(config):
                    pass
            assert info.value.stage == "READY" and info.value.missing == [0]
            tg.cancel_scope.cancel()
    finally:
        engine.close()


async def test_handshake_timeout_without_hello_names_hello() -> None:
    config = EngineCoreClientConfig(transport=HandshakeTransport(f"tcp://127.0.0.1:{free_port()}"),
                                    engine_count=2, ready_timeout=0.2)
    with pytest.raises(HandshakeTimeoutError, match="HELLO") as info:
        async with EngineCoreClient.connect(config):
            pass
    assert info.value.missing == [0, 1]


async def test_unsupported_vllm_version_is_refused() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = FakeEngine(version="0.29.1")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.handshake, address)
            with pytest.raises(UnsupportedVersionError, match=r"0\.29\.1.*0\.32"):
                async with EngineCoreClient.connect(EngineCoreClientConfig(
                        transport=HandshakeTransport(address), ready_timeout=5)):
                    pass
            tg.cancel_scope.cancel()
    finally:
        engine.close()


async def test_multipart_logprobs_are_decoded() -> None:
    async with Cluster() as (client, (engine,)):
        async with client.call(req("req-1")) as stream:
            await engine.receive_add()
            aux: list[bytes | memoryview] = [b""]
            ids = encode_array(np.arange(1, 7, dtype="<i4").reshape(2, 3), aux)
            aux.append(np.arange(1, 7, dtype="<f4").tobytes())
            lps = ["<f4", [2, 3], len(aux) - 1]
            aux.append(np.array([1, 2], dtype="<i4").tobytes())
            ranks = ["<i4", [2], len(aux) - 1]
            ids = ["<i4", [2, 3], len(aux)]
            aux.append(np.arange(1, 7, dtype="<i4").tobytes())
            import msgpack

            row = ["req-1", [7, 8], [ids, lps, ranks, None], None, None, 1] + [None] * 7 + [0]
            row += [None] * 4
            aux[0] = msgpack.packb([0, [row], None, 0.0, None, None, None, None, None])
            assert len(aux) == 4
            await engine.send_raw(aux)
            (item,) = [i async for i in stream]
        logprobs = item.output.new_logprobs
        assert logprobs is not None
        assert [tuple(e) for e in logprobs.positions[0]] == [(1, 1.0, 1), (2, 2.0, 1),
                                                             (3, 3.0, 2)]
        assert [tuple(e) for e in logprobs.positions[1]] == [(4, 4.0, 2), (5, 5.0, 1),
                                                             (6, 6.0, 2)]


async def test_explicit_abort_synthesizes_terminal_output_then_sends_abort() -> None:
    async with Cluster() as (client, (engine,)):
        async with client.call(req("req-1")) as stream:
            await engine.receive_add()
            await engine.send([out("req-1", [7])])
            first = await stream.__anext__()
            assert first.output.new_token_ids == [7]
            await client.abort(["req-1", "unknown"])
            terminal = await stream.__anext__()
            assert terminal.output.finish_reason is EngineCoreFinishReason.ABORT
            assert terminal.output.new_token_ids == []
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
        abort = await engine.receive_abort()
        assert abort.request_ids == ("req-1",)
        await engine.expect_nothing(0.1)


async def test_multi_engine_routing_and_grouped_aborts() -> None:
    async with Cluster(2, client_index=5) as (client, engines):
        assert client.engine_count == 2
        assert client.engine_identities == [b"\x00\x00", b"\x01\x00"]
        assert len(client.ready_responses) == 2
        async with client.call(req("req-1")) as s1, client.call(req("req-2")) as s2:
            assert (await engines[0].receive_add()).request.request_id == "req-1"
            assert (await engines[1].receive_add()).request.request_id == "req-2"
            assert (s1.engine_index, s2.engine_index) == (0, 1)
            await engines[0].send([out("req-1", [1], LENGTH)])
            assert [i.engine_index async for i in s1] == [0]
            async with client.call(req("req-3")) as s3:
                assert (await engines[0].receive_add()).request.request_id == "req-3"
                await client.abort(["req-2", "req-3", "unknown"])
                assert [i.output.finish_reason async for i in s3] == [
                    EngineCoreFinishReason.ABORT]
                assert [(i.engine_index, i.output.finish_reason) async for i in s2] == [
                    (1, EngineCoreFinishReason.ABORT)]
        assert (await engines[0].receive_abort()).request_ids == ("req-3",)
        assert (await engines[1].receive_abort()).request_ids == ("req-2",)


async def test_routing_prefers_scheduler_stats_and_pins_by_rank() -> None:
    async with Cluster(2) as (client, engines):
        await engines[0].send([], scheduler_stats=SchedulerStats(num_running_reqs=5,
                                                                 num_waiting_reqs=2))
        # the reader takes the stats-only message in its own time: bounded wait for it
        await wait_until(lambda: client.engine_load() == {0: 7, 1: 0})
        async with client.call(req("a")) as a, client.call(req("b", data_parallel_rank=0)) as b:
            assert (a.engine_index, b.engine_index) == (1, 0)
        with pytest.raises(InvalidRequestError, match="data_parallel_rank"):
            async with client.call(req("c", data_parallel_rank=9)):
                pass


async def test_utility_fan_out_consensus_and_and() -> None:
    async with Cluster(2) as (client, engines):
        async def answer(method: str, results: list[object]) -> None:
            for engine, result in zip(engines, results, strict=True):
                call = await engine.receive_utility()
                assert call.method == method
                await engine.reply(call, result)

        async with anyio.create_task_group() as tg:
            tg.start_soon(answer, "is_sleeping", [True, True])
            assert await client.is_sleeping() is True
        async with anyio.create_task_group() as tg:
            tg.start_soon(answer, "is_sleeping", [True, False])
            with pytest.raises(InconsistentUtilityResultsError):
                await client.is_sleeping()
        async with anyio.create_task_group() as tg:
            tg.start_soon(answer, "reset_prefix_cache", [True, False])
            assert await client.reset_prefix_cache() is False
        async with anyio.create_task_group() as tg:
            tg.start_soon(answer, "collective_rpc", [["engine-0-worker"], ["engine-1-worker"]])
            assert await client.collective_rpc("m") == ["engine-0-worker", "engine-1-worker"]


async def test_utility_failure_is_raised_after_all_engines_reply() -> None:
    async with Cluster(2) as (client, engines):
        done = anyio.Event()

        async def call() -> None:
            with pytest.raises(UtilityCallError, match="boom") as info:
                await client.call_utility("test_mutation")
            assert info.value.method == "test_mutation"
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            c0 = await engines[0].receive_utility()
            c1 = await engines[1].receive_utility()
            assert client.pending_utility_calls == 2
            await engines[0].reply(c0, failure="boom")
            await wait_until(lambda: client.pending_utility_calls == 1)  # c0's reply read
            await anyio.sleep(0.05)  # room for a caller raising early to show it (negative)
            assert not done.is_set() and client.pending_utility_calls == 1
            await engines[1].reply(c1, None)


async def test_cancelled_utility_call_unregisters_its_waiter() -> None:
    async with Cluster() as (client, (engine,)):
        with anyio.move_on_after(0.1):
            await client.call_utility("is_sleeping")
        await engine.receive_utility()
        assert client.pending_utility_calls == 0


async def test_bootstrapped_connect_with_start_index_3() -> None:
    inp, outp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = EngineCoreClientConfig(
        transport=BootstrappedTransport(input_address=inp, output_address=outp),
        engine_start_index=3, ready_timeout=5)
    engine = FakeEngine(3)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.register, inp, outp)
            async with EngineCoreClient.connect(config) as client:
                assert client.engine_identities == [b"\x03\x00"]
                async with client.call(req("r")) as stream:
                    assert (await engine.receive_add()).request.request_id == "r"
                    await engine.send([out("r", [1], LENGTH)])
                    assert len([i async for i in stream]) == 1
    finally:
        engine.close()


async def test_bootstrapped_rejects_unexpected_engine_id() -> None:
    inp, outp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = EngineCoreClientConfig(
        transport=BootstrappedTransport(input_address=inp, output_address=outp),
        engine_start_index=3, ready_timeout=5)
    engine = FakeEngine(0)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.register, inp, outp)
            with pytest.raises(HandshakeError, match="unexpected engine id"):
                async with EngineCoreClient.connect(config):
                    pass
    finally:
        engine.close()


async def test_leaving_connect_closes_open_streams() -> None:
    async with Cluster() as (client, (engine,)):
        async with client.call(req("r")) as stream:
            await engine.receive_add()
            connection_client = client
        del stream
    with pytest.raises(ClientClosedError):
        async with connection_client.call(req("r2")):
            pass


async def test_stalled_consumer_does_not_delay_100_other_streams() -> None:
    async with Cluster() as (client, (engine,)), client.call(req("stalled")) as stalled:
        await engine.receive_add()
        finished = 0

        async def consume(i: int) -> None:
            nonlocal finished
            async with client.call(req(f"r{i}")) as stream:
                async for item in stream:
                    if item.output.finished:
                        finished += 1

        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(consume, i)
            for _ in range(100):
                await engine.receive_add()
            ids = [f"r{i}" for i in range(100)]
            for step in range(20):
                batch = [out(r, [step]) for r in ids] + [out("stalled", [step])]
                await engine.send(batch)
            with anyio.fail_after(5):
                await engine.send([out(r, [0], LENGTH) for r in ids])
        assert finished == 100
        # The stalled stream buffered every token and lost none.
        await engine.send([out("stalled", [1], LENGTH)])
        tokens = [i.output.new_token_ids[0] async for i in stalled]
        assert tokens == [*range(20), 1]


async def test_1000_random_cancellations_abort_each_id_exactly_once() -> None:
    rng = random.Random(7)
    async with Cluster() as (client, (engine,)):
        added: list[str] = []
        aborted: list[str] = []
        finished: set[str] = set()

        async def engine_side() -> None:
            while True:
                request = await engine.receive()
                if hasattr(request, "request"):
                    added.append(request.request.request_id)
                    rid = request.request.request_id
                    n = int(rid[1:])
                    if n % 3 == 0:
                        finished.add(rid)
                        await engine.send([out(rid, [1]), ])
                        await engine.send([out(rid, [2], LENGTH)])
                    else:
                        await engine.send([out(rid, [1])])
                elif hasattr(request, "request_ids"):
                    aborted.extend(request.request_ids)

        opened = 0

        async def one(i: int) -> None:
            nonlocal opened
            with anyio.move_on_after(rng.random() * 0.05):
                async with client.call(req(f"r{i}")) as stream:
                    opened += 1  # a task cancelled before this point sent nothing
                    async for _ in stream:
                        pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(engine_side)
            async with anyio.create_task_group() as users:
                for i in range(1000):
                    users.start_soon(one, i)
            with anyio.fail_after(5):
                await wait_until(
                    lambda: len(added) == opened and set(aborted) | finished == set(added))
                await anyio.sleep(0.1)
            tg.cancel_scope.cancel()
        assert client.in_flight == 0
        assert len(aborted) == len(set(aborted))
        assert set(aborted) | finished == set(added)
        assert client.aborts_sent == len(aborted)



async def test_aborts_queued_when_the_client_closes_are_still_sent() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = FakeEngine()
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), ready_timeout=5)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.handshake, address)
            async with EngineCoreClient.connect(config) as client:
                with anyio.move_on_after(0.05):
                    async with client.call(req("a")), client.call(req("b")):
                        await anyio.sleep_forever()
                # Leave the client at once: the abort worker has had no chance to run.
        ids: list[str] = []
        with anyio.fail_after(2):
            while len(ids) < 2:
                request = await engine.receive()
                if hasattr(request, "request_ids"):
                    ids.extend(request.request_ids)
        assert sorted(ids) == ["a", "b"]
    finally:
        engine.close()
