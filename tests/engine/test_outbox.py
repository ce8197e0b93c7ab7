"""The input socket's send queue: messages leave in the order they were queued, without the
caller waiting, and nothing queued before a close is lost."""

from __future__ import annotations

import anyio
import pytest
import zmq

from anyio_genout.engine.outbox import FLUSH_AT, Outbox
from anyio_genout.transport import ZmqSocket, new_context

pytestmark = pytest.mark.anyio


async def test_messages_queued_by_many_tasks_leave_in_queue_order() -> None:
    ctx = new_context()
    try:
        pull = ZmqSocket(ctx, zmq.PULL)
        push = ZmqSocket(ctx, zmq.PUSH)
        push.connect(pull.bind("tcp://127.0.0.1:*"))
        outbox = Outbox(push)
        queued: list[bytes] = []

        async def caller(n: int) -> None:
            for i in range(20):
                message = b"%d-%d" % (n, i)
                outbox.put([message])  # never waits
                queued.append(message)
                if i % 3 == 0:
                    await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(outbox.run)
            async with anyio.create_task_group() as callers:
                for n in range(5):
                    callers.start_soon(caller, n)
            with anyio.fail_after(5):
                got = [bytes((await pull.receive())[0].buffer) for _ in range(100)]
            tg.cancel_scope.cancel()
        assert got == queued
        assert len(outbox) == 0
        push.close()
        pull.close()
    finally:
        ctx.term()


async def test_flush_sends_what_is_queued_and_a_closed_socket_refuses_more() -> None:
    ctx = new_context()
    try:
        pull = ZmqSocket(ctx, zmq.PULL)
        push = ZmqSocket(ctx, zmq.PUSH)
        push.connect(pull.bind("tcp://127.0.0.1:*"))
        outbox = Outbox(push)  # no sender task: only flush() sends
        for i in range(3):
            outbox.put([b"m%d" % i, b"aux"])
        assert len(outbox) == 3
        outbox.flush()
        with anyio.fail_after(5):
            got = [[bytes(f.buffer) for f in await pull.receive()] for _ in range(3)]
        assert got == [[b"m0", b"aux"], [b"m1", b"aux"], [b"m2", b"aux"]]
        push.close()
        with pytest.raises(anyio.ClosedResourceError):
            outbox.put([b"late"])
        pull.close()
    finally:
        ctx.term()


async def test_a_long_burst_is_sent_as_it_is_made() -> None:
    """Every FLUSH_AT queued messages go out at once, without waiting for the sender task,
    so the engine can start on a burst's first requests while the rest are being made."""
    ctx = new_context()
    try:
        pull = ZmqSocket(ctx, zmq.PULL)
        push = ZmqSocket(ctx, zmq.PUSH)
        push.connect(pull.bind("tcp://127.0.0.1:*"))
        outbox = Outbox(push)  # no sender task
        for i in range(FLUSH_AT + 3):
            outbox.put([b"m%d" % i])
        with anyio.fail_after(5):
            got = [bytes((await pull.receive())[0].buffer) for _ in range(FLUSH_AT)]
        assert got == [b"m%d" % i for i in range(FLUSH_AT)]
        assert len(outbox) == 3  # the rest waits for the sender (or a flush)
        push.close()
        pull.close()
    finally:
        ctx.term()
