from __future__ import annotations

import anyio
import pytest
import zmq

from anyio_genout.transport import ZmqSocket, new_context

pytestmark = pytest.mark.anyio


async def test_push_pull_roundtrip_and_close_wakes_receiver() -> None:
    ctx = new_context()
    try:
        pull = ZmqSocket(ctx, zmq.PULL)
        address = pull.bind("tcp://127.0.0.1:*")
        push = ZmqSocket(ctx, zmq.PUSH)
        push.connect(address)
        for i in range(100):
            await push.send([b"x%d" % i, b"aux"])
        got = [bytes((await pull.receive())[0]) for _ in range(100)]
        assert got == [b"x%d" % i for i in range(100)]

        async def close_soon() -> None:
            await anyio.sleep(0.05)
            pull.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(close_soon)
            with pytest.raises(anyio.ClosedResourceError):
                await pull.receive()
        push.close()
    finally:
        ctx.term()
