"""The output mailbox parks its one consumer on each backend's own primitive; these pin the
corner cases an ``anyio.Event`` used to handle for it."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import TaskStatus

from anyio_genout.engine.mailbox import OutputMailbox, mailbox_factory
from anyio_genout.protocol import EngineCoreOutput
from anyio_genout.readiness import running_library

pytestmark = pytest.mark.anyio


def _put(box: OutputMailbox, n: int) -> None:
    box.put_output(float(n), EngineCoreOutput(f"r{n}", [n]))


async def _drain(box: OutputMailbox, got: list[float], count: int) -> None:
    """Read ``count`` outputs (or until closed), recording their timestamps."""
    while len(got) < count:
        while not box.items and not box.closed:
            await box.wait()
        if not box.items:
            return
        timestamp = box.items.popleft()
        output = box.items.popleft()
        assert isinstance(timestamp, float) and isinstance(output, EngineCoreOutput)
        assert output.request_id == f"r{int(timestamp)}"
        got.append(timestamp)


async def test_a_parked_consumer_wakes_for_each_put_and_for_close() -> None:
    box = mailbox_factory()()
    got: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_drain, box, got, 10)
        for n in range(3):
            await anyio.wait_all_tasks_blocked()
            assert box.waiter is not None  # parked
            _put(box, n)
        await anyio.wait_all_tasks_blocked()
        box.close()
    assert got == [0.0, 1.0, 2.0]
    assert box.waiter is None


async def test_cancelling_a_parked_consumer_then_putting_at_once_neither_wakes_nor_loses() -> None:
    """The reader may put an item after the consumer's scope was cancelled but before the
    consumer ran again: the put must not wake (or reschedule) a consumer that is leaving,
    and the item stays in the mailbox."""
    box = mailbox_factory()()
    cancelled = anyio.Event()

    async def consumer(*, task_status: TaskStatus[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            await box.wait()
        assert scope.cancelled_caught
        cancelled.set()

    async with anyio.create_task_group() as tg:
        scope = await tg.start(consumer)
        await anyio.wait_all_tasks_blocked()
        assert box.waiter is not None
        scope.cancel()
        _put(box, 1)  # same step: the consumer has not run since the cancel
        box.put_error(RuntimeError("and an error after it"))
        box.close()
        with anyio.fail_after(5):
            await cancelled.wait()
    assert box.waiter is None
    assert len(box.items) == 3  # the output (two entries) and the error: nothing lost


async def test_a_woken_consumer_can_park_again_and_a_put_before_parking_is_seen() -> None:
    box = mailbox_factory()()
    _put(box, 0)  # before anyone waits: no wake-up needed, the item is there
    got: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_drain, box, got, 50)
        for n in range(1, 50):
            _put(box, n)
            if n % 7 == 0:
                await anyio.wait_all_tasks_blocked()
            else:
                await anyio.lowlevel.checkpoint()
    assert got == [float(n) for n in range(50)]


async def test_discard_drops_items_and_refuses_more() -> None:
    box = mailbox_factory()()
    _put(box, 0)
    box.discard()
    _put(box, 1)
    box.put_error(RuntimeError("late"))
    assert not box.items and box.closed


async def test_the_running_library_is_the_backend_in_use(
        anyio_backend: tuple[str, dict[str, object]]) -> None:
    """How mailboxes and descriptor waits pick their primitive (no sniffio needed)."""
    assert running_library() == anyio_backend[0]
    assert type(mailbox_factory()()).__name__.lower().startswith(f"_{anyio_backend[0]}")


async def _park_once(box: OutputMailbox, *, task_status: TaskStatus[anyio.CancelScope]) -> None:
    with anyio.CancelScope() as scope:
        task_status.started(scope)
        await box.wait()


async def test_a_second_waiter_is_refused_at_once_and_the_first_keeps_its_place() -> None:
    """One slot: a second task must not overwrite the first one's (it would never wake)."""
    box = mailbox_factory()()
    got: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_drain, box, got, 1)
        await anyio.wait_all_tasks_blocked()
        assert box.waiter is not None
        with anyio.fail_after(1), pytest.raises(anyio.BusyResourceError,
                                                match="another task is already iterating"):
            await box.wait()
        _put(box, 7)  # wakes the first waiter, which reads it
    assert got == [7.0]
    assert box.waiter is None


async def test_cancelling_one_waiter_never_strands_another() -> None:
    """Reader A parks, reader B is refused; cancelling A frees the slot, so B can park and is
    woken by the next put. (When B overwrote the slot, cancelling A cleared B's registration
    on trio, and B slept through every later put.)"""
    box = mailbox_factory()()
    got: list[float] = []
    async with anyio.create_task_group() as tg:
        scope_a = await tg.start(_park_once, box)
        await anyio.wait_all_tasks_blocked()
        with anyio.fail_after(1), pytest.raises(anyio.BusyResourceError):
            await box.wait()
        scope_a.cancel()
    assert box.waiter is None
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_drain, box, got, 1)
            await anyio.wait_all_tasks_blocked()
            _put(box, 3)
    assert got == [3.0]


async def test_discard_wakes_a_parked_consumer() -> None:
    """A stream closed from another task: its parked consumer must wake to see it."""
    box = mailbox_factory()()
    got: list[float] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_drain, box, got, 1)
            await anyio.wait_all_tasks_blocked()
            box.discard()
    assert got == [] and box.closed and box.waiter is None


async def test_a_waiter_cancelled_a_moment_ago_does_not_block_the_next() -> None:
    """Cancelled, but not yet run since: that waiter is leaving, so a new one may park (on
    asyncio its cancelled future is still in the slot until it runs)."""
    box = mailbox_factory()()
    async with anyio.create_task_group() as tg:
        scope_a = await tg.start(_park_once, box)
        await anyio.wait_all_tasks_blocked()
        scope_a.cancel()
        tg.start_soon(_put_soon, box)  # puts once A has left
        with anyio.fail_after(5):
            # No BusyResourceError: the slot is free; and A, leaving, must not clear this
            # registration, or the put would not wake us.
            await box.wait()
        assert box.waiter is None
    assert len(box.items) == 2


async def _put_soon(box: OutputMailbox) -> None:
    await anyio.wait_all_tasks_blocked()
    _put(box, 1)
