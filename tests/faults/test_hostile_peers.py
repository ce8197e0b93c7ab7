"""Hostile or broken peers pushing into the client's output socket, end to end over ZeroMQ.

A raw PUSH socket (not the engine) connects to the client's output address, the way anyone
who can reach that port can, and sends what hypothesis makes: random bytes, random multipart
messages, truncated messages, array references to frames that do not exist, huge declared
array shapes, pickle extension types. Each example gets a fresh client with one open request
and checks: the client fails with a ProtocolError (the open stream gets exactly one), or,
if the bytes happened to be valid, keeps working; nothing else is raised, nothing hangs, the
process lives, memory stays bounded, and pickle is never run.
"""

from __future__ import annotations

import gc
import logging
import pickle
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgpack
import numpy as np
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from anyio_genout import (
    BootstrappedTransport,
    EngineCoreClient,
    EngineCoreClientConfig,
    EngineCoreOutputStream,
    EngineCoreRequest,
    EngineDeadError,
    ProtocolError,
    SamplingParams,
)
from anyio_genout.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    Logprobs,
    encode_outputs,
)
from anyio_genout.testing import input_junk
from anyio_genout.transport import MonitorEvent
from tests.cluster import mock_cluster
from tests.engine.fake import FakeEngine, free_port
from tests.support import wait_until

from .support import RawPeer, drain, engine_request, raw_pusher

pytestmark = pytest.mark.anyio

HOSTILE = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
)

CANARY = 424242  # a token only the canary message carries
RID = "victim"


def pack(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


class Target:
    """A connected client (bootstrapped, one fake engine) with one request in flight."""

    def __init__(self, client: EngineCoreClient, engine: FakeEngine,
                 stream: EngineCoreOutputStream) -> None:
        self.client = client
        self.engine = engine
        self.stream = stream


@asynccontextmanager
async def target(**config: Any) -> AsyncIterator[Target]:
    inp, outp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = EngineCoreClientConfig(
        transport=BootstrappedTransport(input_address=inp, output_address=outp),
        ready_timeout=5, **config)
    engine = FakeEngine()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.register, inp, outp)
            async with EngineCoreClient.connect(cfg) as client, \
                    client.call(engine_request(RID, max_tokens=100)) as stream:
                await engine.receive_add()
                yield Target(client, engine, stream)
    finally:
        engine.close()


def canary() -> list[bytes | memoryview]:
    """A valid output for the open request, carrying CANARY."""
    return encode_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput(RID, [CANARY])]))


async def push_and_judge(frames: list[bytes], *, must_fail: bool) -> None:
    """Send ``frames`` from a third party, then the canary from the same socket (ZeroMQ keeps
    one connection's order). The stream sees exactly one ProtocolError, or the canary; or,
    for the engine's own death sentinel (valid bytes, which hypothesis finds among the
    constants of our source), exactly one EngineDeadError."""
    async with target() as t, raw_pusher(t.client.output_address) as attacker:
        await attacker.send(frames)
        await attacker.send(list(canary()))  # type: ignore[arg-type]
        with anyio.fail_after(5):
            if frames == [ENGINE_CORE_DEAD]:
                with pytest.raises(EngineDeadError):
                    await t.stream.__anext__()
                assert not t.client.is_healthy
                with pytest.raises(StopAsyncIteration):
                    await t.stream.__anext__()
                return
            try:
                item = await t.stream.__anext__()
            except ProtocolError:
                assert not t.client.is_healthy
                assert isinstance(t.client.health_error, ProtocolError)
                with pytest.raises(StopAsyncIteration):
                    await t.stream.__anext__()
                with pytest.raises(ProtocolError):  # later calls fail at once
                    await t.client.is_sleeping()
                return
        assert not must_fail, f"accepted hostile frames {frames!r:.200}"
        # Valid after all (random bytes can be valid msgpack for an empty batch): the
        # client is healthy and the canary arrived, possibly after outputs the bytes held.
        while CANARY not in item.output.new_token_ids:
            with anyio.fail_after(5):
                item = await t.stream.__anext__()
        assert t.client.is_healthy


# ---------------------------------------------------------------- strategies


def valid_message() -> list[bytes]:
    """A real multipart message: logprobs in aux frames (as vLLM sends them)."""
    n, k = 4, 40
    logprobs = Logprobs(np.arange(n * k, dtype=np.int32).reshape(n, k),
                        np.linspace(-1, -2, n * k, dtype=np.float32).reshape(n, k),
                        np.ones(n, dtype=np.int64))
    out = EngineCoreOutput(RID, [1, 2, 3], new_logprobs=logprobs)
    frames = encode_outputs(EngineCoreOutputs(outputs=[out]))
    assert len(frames) > 1
    return [bytes(f) for f in frames]


def row(**fields: Any) -> list[Any]:
    values = [RID, [1]] + [None] * 11 + [0] + [None] * 4
    names = ["request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs_tensors",
             "pooling_output", "finish_reason", "stop_reason", "events",
             "kv_transfer_params", "ec_transfer_params", "trace_headers", "prefill_stats",
             "routed_experts", "num_nans_in_logits", "mm_cache_miss_hashes",
             "new_sampling_mask", "spec_decode_metrics", "prompt_token_id_logprobs"]
    for name, value in fields.items():
        values[names.index(name)] = value
    return values


def message(rows: list[Any], *aux: bytes) -> list[bytes]:
    return [pack([0, rows, None, 1.0, None, None, None, None, None]), *aux]


ARRAY_FIELDS = ["pooling_output", "routed_experts", "prompt_token_id_logprobs"]

pickle_ran: list[str] = []


def _pwned() -> str:
    pickle_ran.append("pickle was deserialised")
    return "pwned"


class Exploit:
    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_pwned, ())


# ---------------------------------------------------------------- tests


@HOSTILE
@given(data=st.binary(max_size=200))
@example(data=ENGINE_CORE_DEAD)
async def test_random_bytes(data: bytes) -> None:
    await push_and_judge([data], must_fail=False)


@HOSTILE
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=6))
@example(frames=[ENGINE_CORE_DEAD])
async def test_random_multipart(frames: list[bytes]) -> None:
    await push_and_judge(frames, must_fail=False)


@HOSTILE
@given(data=st.data())
async def test_truncated_messages(data: st.DataObject) -> None:
    frames = valid_message()
    how = data.draw(st.sampled_from(["main", "aux", "drop"]))
    if how == "main":  # a cut main frame is never complete msgpack
        cut = data.draw(st.integers(0, len(frames[0]) - 1))
        frames[0] = frames[0][:cut]
    elif how == "aux":  # an aux frame shorter than its declared array
        i = data.draw(st.integers(1, len(frames) - 1))
        frames[i] = frames[i][:data.draw(st.integers(0, len(frames[i]) - 1))]
    else:  # trailing aux frames lost
        frames = frames[:data.draw(st.integers(1, len(frames) - 1))]
    await push_and_judge(frames, must_fail=True)


@HOSTILE
@given(field=st.sampled_from(ARRAY_FIELDS),
       index=st.one_of(st.integers(-2**63, 0), st.integers(2, 2**64 - 1)))
async def test_aux_index_out_of_range(field: str, index: int) -> None:
    frames = message([row(**{field: ["<f4", [2], index]})], np.zeros(2, "<f4").tobytes())
    await push_and_judge(frames, must_fail=True)


@HOSTILE
@given(field=st.sampled_from(ARRAY_FIELDS),
       shape=st.lists(st.integers(2**16, 2**62), min_size=1, max_size=4),
       dtype=st.sampled_from(["<f4", "<i8", "float32", "bfloat16", "|u1"]),
       inline=st.booleans())
async def test_huge_declared_shapes(field: str, shape: list[int], dtype: str,
                                    inline: bool) -> None:
    payload = b"\x00" * 64
    data = msgpack.ExtType(3, payload) if inline else 1
    frames = message([row(**{field: [dtype, shape, data]})], *([] if inline else [payload]))
    await push_and_judge(frames, must_fail=True)


@HOSTILE
@given(code=st.sampled_from([1, 2]),
       where=st.sampled_from(["array", "field", "utility", "top"]))
async def test_pickle_extension_types_are_refused(code: int, where: str) -> None:
    payload = msgpack.ExtType(code, pickle.dumps(Exploit()))
    if where == "array":
        frames = message([row(pooling_output=["<f4", [1], payload])])
    elif where == "field":
        frames = message([row(kv_transfer_params={"x": payload})])
    elif where == "utility":
        frames = [pack([0, [], None, 1.0, [1, None, [payload, 1]], None, None, None, None])]
    else:
        frames = [pack(payload)]
    await push_and_judge(frames, must_fail=True)
    assert pickle_ran == []


async def test_memory_stays_bounded_under_huge_declared_arrays() -> None:
    """Thousands of messages declaring exabyte arrays allocate nothing: each fails fast."""
    process = psutil.Process()
    gc.collect()
    before = process.memory_info().rss
    for _ in range(20):
        frames = message([row(pooling_output=["<f8", [2**30, 2**30], 1])], b"\x00" * 8)
        await push_and_judge(frames, must_fail=True)
    gc.collect()
    assert process.memory_info().rss - before < 64 * 2**20


async def test_an_engine_message_over_max_message_size_fails_its_streams_naming_the_limit(
        ) -> None:
    """ZeroMQ drops a message over ZMQ_MAXMSGSIZE before any of it reaches this process and
    closes that connection (messages behind it go too); the engine's PUSH reconnects by
    itself and reports nothing. The client sees the connection close and come back while
    the engine still answers: outputs were lost, so every open stream ends with one
    ProtocolError naming max_message_size and its value, instead of waiting forever."""
    limit = 64 * 1024
    async with mock_cluster(mock={"step_time": 0.01}, max_message_size=limit) as cluster:
        client = cluster.client
        errors: list[BaseException | None] = []
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(_call, client, engine_request(f"r{i}", max_tokens=4_000),
                                  errors)
                await wait_until(lambda: client.in_flight == 3)
                started = anyio.current_time()
                # Prompt logprobs of a 1000-token prompt: 1000 x 21 x 4 bytes in an aux frame.
                params = SamplingParams(temperature=0.0, max_tokens=4_000, prompt_logprobs=20)
                big = EngineCoreRequest(request_id="big", prompt_token_ids=tuple(range(1, 1001)),
                                        sampling_params=params, arrival_time=1.0)
                tg.start_soon(_call, client, big, errors)
        detected = anyio.current_time() - started
        assert len(errors) == 4 and all(isinstance(e, ProtocolError) for e in errors), errors
        message = str(client.health_error)
        assert "max_message_size (65,536 bytes)" in message, message
        assert detected < 2.0, detected  # a probe round trip, not a grace period
        assert client.output_disconnects == 1


async def test_a_third_party_message_over_max_message_size_costs_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    """A stranger's oversized message: ZeroMQ drops it with the stranger's connection, which
    keeps coming back and resending it. Every time, the engine answers over its own
    connection, which never closed, so no engine output was lost: the client stays healthy
    and the streams go on (each drop is logged)."""
    limit = 64 * 1024
    async with mock_cluster(mock={"step_time": 0.005}, max_message_size=limit) as cluster:
        client = cluster.client
        caplog.set_level(logging.INFO, logger="anyio_genout.engine")
        async with client.call(engine_request("goes-on", max_tokens=100)) as stream:
            async with raw_pusher(client.output_address) as attacker:
                await attacker.send([b"\x00" * (limit + 1)])
                await wait_until(lambda: any("not an engine" in r.getMessage()
                                             for r in caplog.records))
            with anyio.fail_after(5):
                items, error = await drain(stream)
        assert error is None and sum(len(i.output.new_token_ids) for i in items) == 100
        assert client.is_healthy and client.output_disconnects >= 1
        drops = [r.getMessage() for r in caplog.records if "closed (" in r.getMessage()]
        assert len(drops) == client.output_disconnects


async def _call(client: EngineCoreClient, request: EngineCoreRequest,
                errors: list[BaseException | None]) -> None:
    async with client.call(request) as stream:
        errors.append((await drain(stream))[1])


async def test_messages_sent_to_the_input_socket_are_discarded() -> None:
    """Engines never send on the input socket after registering; a peer that does cannot
    grow this process's memory (the client drains and drops it)."""
    process = psutil.Process()
    async with target() as t:
        intruder = RawPeer(zmq.DEALER, identity=b"intruder").connect(t.client.input_address)
        try:
            gc.collect()
            before = process.memory_info().rss
            blob = b"\x00" * 2**20
            for _ in range(256):  # 256 MiB in total
                await intruder.send([blob])
            await wait_until(lambda: input_junk(t.client) >= 256, 10)
            gc.collect()
            assert process.memory_info().rss - before < 96 * 2**20
            assert t.client.is_healthy
        finally:
            intruder.close()
        await t.engine.send([EngineCoreOutput(RID, [1])])
        with anyio.fail_after(5):
            assert (await t.stream.__anext__()).output.new_token_ids == [1]


async def test_garbage_from_a_third_party_fails_every_stream_once() -> None:
    """Many streams open: one junk message ends each with exactly one ProtocolError."""
    async with target() as t, raw_pusher(t.client.output_address) as attacker:
        others = []
        async with t.client.call(engine_request("other-1")) as s1, \
                t.client.call(engine_request("other-2")) as s2:
            others = [s1, s2]
            await attacker.send([b"\x92\xc1"])
            for stream in (t.stream, *others):
                with anyio.fail_after(5):
                    items, error = await drain(stream)
                assert items == [] and isinstance(error, ProtocolError)


async def test_a_third_party_leaving_and_port_scans_leave_the_client_healthy(
        caplog: pytest.LogCaptureFixture) -> None:
    """A peer that spoke ZeroMQ to the output socket and left is reported and checked: every
    engine answers over its own connection and nothing reconnected, so it was not an engine
    and nothing was lost; the stream in flight goes on. A TCP connection that never
    completed ZeroMQ's handshake (a port scan) is not even reported.

    The cluster binds a loopback address of its own: a peer of another test that still
    reconnects to the port it had (the suite runs thousands of sockets, two workers at once)
    would be one more third party leaving, counted as it should be, and fail the count."""
    host = f"127.{random.randrange(1, 255)}.{random.randrange(1, 255)}.{random.randrange(2, 255)}"
    async with mock_cluster(mock={"step_time": 0.01}, host=host) as cluster:
        client = cluster.client
        caplog.set_level(logging.INFO, logger="anyio_genout.engine")
        async with client.call(engine_request("goes-on", max_tokens=60)) as stream:
            port = int(client.output_address.rsplit(":", 1)[1])
            for _ in range(3):
                tcp = await anyio.connect_tcp(host, port)
                async with tcp:
                    await tcp.send(b"GET / HTTP/1.0\r\n\r\n")
            # A peer whose ZeroMQ handshake completed before it left: closed before that,
            # it would be one more port scan, never reported. Its monitor is made before it
            # connects, so the event cannot come first.
            peer = RawPeer(zmq.PUSH)
            monitor = peer.socket.monitor(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            try:
                peer.connect(client.output_address)
                await peer.send(list(encode_outputs(EngineCoreOutputs())))  # type: ignore[arg-type]
                with anyio.fail_after(5):
                    while True:
                        event = MonitorEvent.parse(await monitor.receive())
                        if event is not None and event.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                            break
            finally:
                monitor.close()
                peer.socket.close(linger=1.0)  # its message leaves before it does
                peer.close()
            await wait_until(lambda: any("not an engine" in r.getMessage()
                                         for r in caplog.records))
            items, error = await drain(stream)
        assert error is None and items[-1].output.finished
        assert sum(len(i.output.new_token_ids) for i in items) == 60
        assert client.is_healthy and client.output_disconnects == 1
        assert len([r for r in caplog.records if "closed (" in r.getMessage()]) == 1
