from __future__ import annotations

import os

import anyio
import pytest
import zmq

from anyio_genout.readiness import FdWaiter
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


async def test_multipart_messages_keep_their_parts_and_boundaries() -> None:
    """Parts of one message arrive together and in order; small parts are copied and a
    large one is sent without a copy, and both arrive intact."""
    ctx = new_context()
    try:
        pull = ZmqSocket(ctx, zmq.PULL)
        push = ZmqSocket(ctx, zmq.PUSH)
        push.connect(pull.bind("tcp://127.0.0.1:*"))
        big = bytes(range(256)) * 1024  # above the zero-copy threshold
        messages = [[b"a"], [b"b1", b"b2", b"b3"], [b"", big], [memoryview(b"c1"), b"c2"]]
        for message in messages:
            assert push.send_nowait(message)
        got = [[bytes(f.buffer) for f in await pull.receive()] for _ in messages]
        assert got == [[bytes(p) for p in m] for m in messages]
        push.close()
        pull.close()
    finally:
        ctx.term()


async def test_readable_reports_a_queued_message_and_wait_readable_returns_for_it() -> None:
    ctx = new_context()
    try:
        pull = ZmqSocket(ctx, zmq.PULL)
        push = ZmqSocket(ctx, zmq.PUSH)
        push.connect(pull.bind("tcp://127.0.0.1:*"))
        assert not pull.readable()
        assert pull.receive_nowait() is None
        push.send_nowait([b"one"])
        with anyio.fail_after(5):
            await pull.wait_readable()
        assert pull.readable()
        frames = pull.receive_nowait()
        assert frames is not None and bytes(frames[0].buffer) == b"one"
        assert not pull.readable()
        pull.close()
        with pytest.raises(anyio.ClosedResourceError):
            pull.readable()
        with pytest.raises(anyio.ClosedResourceError):
            pull.receive_nowait()
        push.close()
        with pytest.raises(anyio.ClosedResourceError):
            push.send_nowait([b"late"])
    finally:
        ctx.term()


async def test_fd_waiter_wakes_for_readability_and_fails_waiters_on_close() -> None:
    """The descriptor stays registered across waits (asyncio); each wait still returns once
    it is readable (a wake-up may be spurious, never missing), and close fails a waiter."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    waiter = FdWaiter(read_fd)

    async def read_one() -> bytes:
        with anyio.fail_after(5):
            while True:
                try:
                    return os.read(read_fd, 10)
                except BlockingIOError:
                    await waiter.wait()

    try:
        for n in range(20):
            async with anyio.create_task_group() as tg:
                async def write_soon(n: int = n) -> None:
                    await anyio.wait_all_tasks_blocked()
                    os.write(write_fd, bytes([n]))
                tg.start_soon(write_soon)
                assert await read_one() == bytes([n])
        os.write(write_fd, b"x")  # already readable: returns at once
        with anyio.fail_after(5):
            await waiter.wait()
        assert await read_one() == b"x"

        async def second_waiter() -> None:
            await anyio.wait_all_tasks_blocked()
            if waiter._future is not None:  # asyncio: one parked waiter at a time
                with pytest.raises(anyio.BusyResourceError):
                    await waiter.wait()
            waiter.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(second_waiter)
            with anyio.fail_after(5), pytest.raises(anyio.ClosedResourceError):
                while True:
                    await waiter.wait()
        with pytest.raises(anyio.ClosedResourceError):
            await waiter.wait()
    finally:
        waiter.close()
        os.close(read_fd)
        os.close(write_fd)


async def test_fd_waiter_ignores_a_signal_its_ready_check_rejects() -> None:
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    wanted = False
    waiter = FdWaiter(read_fd, lambda: wanted)
    try:
        os.write(write_fd, b"x")
        with anyio.move_on_after(0.2) as scope:
            await waiter.wait()
        # asyncio consults the check; trio's own wait does not have one.
        assert scope.cancelled_caught == (waiter._loop is not None)
        wanted = True
        with anyio.fail_after(5):
            await waiter.wait()
    finally:
        waiter.close()
        os.close(read_fd)
        os.close(write_fd)


def test_free_ports_do_not_follow_the_callers_seeded_random() -> None:
    """Hypothesis (and any caller) seeds the global ``random`` for each run: a picker that
    used it would hand every run the port the previous run had just closed."""
    import random

    from anyio_genout.transport import free_tcp_port

    picked = set()
    for _ in range(5):
        random.seed(1234)
        picked.add(free_tcp_port())
    assert len(picked) > 1, picked


def test_a_free_port_is_not_handed_out_twice_in_a_row() -> None:
    """A caller that asks for two ports before binding either (a server's HTTP port and
    its handshake address) gets two different ones: none of the last 1,024 it handed out
    comes again."""
    from anyio_genout.transport import free_tcp_port

    # 400 picks at random from the 22,768 candidates repeat one 97 % of the time.
    picked = [free_tcp_port() for _ in range(400)]
    assert len(set(picked)) == len(picked)
