"""The output mailbox parks its one consumer on each backend's own primitive; these pin the
corner cases an ``anyio.Event`` used to handle for it."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import TaskStatus

from anyio_genout.engine.mailbox import EngineCoreStreamOutput, OutputMailbox, mailbox_factory
from anyio_genout.protocol import EngineCoreOutput

pytestmark = pytest.mark.anyio


def _item(n: int) -> EngineCoreStreamOutput:
    return EngineCoreStreamOutput(0, float(n), EngineCoreOutput(f"r{n}", [n]))


async def _drain(box: OutputMailbox, got: list[object], count: int) -> None:
    while len(got) < count:
        while not box.items and not box.closed:
            await box.wait()
        if not box.items:
            return
        got.append(box.items.popleft())


async def test_a_parked_consumer_wakes_for_each_put_and_for_close() -> None:
    box = mailbox_factory()()
    got: list[object] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_drain, box, got, 10)
        for n in range(3):
            await anyio.wait_all_tasks_blocked()
            assert box.waiter is not None  # parked
            box.put(_item(n))
        await anyio.wait_all_tasks_blocked()
        box.close()
    assert [item.timestamp for item in got] == [0.0, 1.0, 2.0]  # type: ignore[attr-defined]
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
        box.put(_item(1))  # same step: the consumer has not run since the cancel
        box.close()
        with anyio.fail_after(5):
            await cancelled.wait()
    assert box.waiter is None
    assert len(box.items) == 1


async def test_a_woken_consumer_can_park_again_and_a_put_before_parking_is_seen() -> None:
    box = mailbox_factory()()
    box.put(_item(0))  # before anyone waits: no wake-up needed, the item is there
    got: list[object] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_drain, box, got, 50)
        for n in range(1, 50):
            box.put(_item(n))
            if n % 7 == 0:
                await anyio.wait_all_tasks_blocked()
            else:
                await anyio.lowlevel.checkpoint()
    assert [item.timestamp for item in got] == [float(n) for n in range(50)]  # type: ignore[attr-defined]


async def test_discard_drops_items_and_refuses_more() -> None:
    box = mailbox_factory()()
    box.put(_item(0))
    box.discard()
    box.put(_item(1))
    assert not box.items and box.closed
