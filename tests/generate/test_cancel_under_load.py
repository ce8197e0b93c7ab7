"""A cancel scope around a busy stream fires on time, on every backend.

With the engine in another process outputs keep arriving while the consumer works through
them; on asyncio anyio delivers a cancellation by cancelling the task's future and skips a
task whose future is already done, so a consumer the reader keeps waking could miss it for
the whole stream (a 0.1 s timeout fired after more than a second, at the stream's end)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import anyio
import pytest

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClientConfig,
    GenerateRequest,
    HandshakeTransport,
    SamplingParams,
)
from anyio_genout.engine.parking import CHECK_INTERVAL
from anyio_genout.engine.stream import TIME_SLICE
from tests.support import mock_engine_process, wait_until

pytestmark = pytest.mark.anyio

#: Seconds of blocking work per output (coalesced: per token).
WORK = 0.0002
#: Outputs a consumer may still take once its scope is cancelled, each at least WORK long:
#: the rest of its turn (TIME_SLICE) and, for a ``cancel()`` whose wake-up was pending, up to
#: CHECK_INTERVAL more (parking.py), and two for the passes the cancellation comes in.
#: Missed, it takes thousands (per step, the stream has 4000).
LATE_OUTPUTS = math.ceil((TIME_SLICE + CHECK_INTERVAL) / WORK) + 2


@pytest.fixture
def engine_address() -> Iterator[str]:
    """A mock engine process stepping back to back, dialing this address."""
    with mock_engine_process("--step-time", "0", "--no-log-stats") as address:
        yield address


@pytest.mark.usefixtures("frozen_heap")
@pytest.mark.parametrize("how", ["timeout", "cancel"])
@pytest.mark.parametrize("per_step", [True, False], ids=["per-step", "coalesced"])
async def test_a_timeout_around_a_busy_stream_fires_on_time(engine_address: str,
                                                            per_step: bool, how: str) -> None:
    """Per step: 0.2 ms of work per output. Coalesced, the outputs that waited come as one,
    so the work is per token there (else the consumer keeps up and the stream ends first).
    ``cancel``: another task calls the scope's ``cancel()`` after 0.1 s instead (no deadline
    for the stream to see: only the parking's look for a skipped cancellation finds it).

    On time is counted in outputs: the consumer takes at most ``LATE_OUTPUTS`` after the
    deadline (or the ``cancel()``), however long a loaded machine stalls the process in
    between (a missed cancellation takes them all, up to the stream's end). The time bound
    beside it catches a consumer left parked (taking nothing) past the cancellation; it is
    loose, as the machine may hold this process off the CPU for a while, and the heap is
    frozen so no full collection of earlier tests' objects (0.3-0.6 s) adds to that."""
    config = ClientConfig(engine=EngineCoreClientConfig(
        transport=HandshakeTransport(engine_address), ready_timeout=20), registry=None)
    async with Client.connect(config) as client:
        for n in range(3):
            request = GenerateRequest(request_id=f"busy-{n}", prompt_token_ids=[1, 2, 3],
                                      sampling_params=SamplingParams(max_tokens=4000,
                                                                     ignore_eos=True))
            got = 0
            taken_at: list[float] = []
            cancelled_at: list[float] = []
            async with anyio.create_task_group() as tg:
                with anyio.move_on_after(0.1 if how == "timeout" else 30) as scope:
                    if how == "cancel":
                        tg.start_soon(_cancel_later, scope, cancelled_at)
                    async with client.generate(request, per_step=per_step) as stream:
                        async for out in stream:
                            taken_at.append(anyio.current_time())
                            got += len(out.token_ids)
                            # Work that blocks the loop, as a busy consumer does.
                            time.sleep(WORK * (1 if per_step else len(out.token_ids)))  # noqa: ASYNC251
            left = anyio.current_time()
            assert scope.cancelled_caught, f"the stream ended first ({got} tokens)"
            due = scope.deadline if how == "timeout" else cancelled_at[0]
            late = sum(1 for t in taken_at if t >= due)
            assert late <= LATE_OUTPUTS, (
                f"{late} of {len(taken_at)} outputs ({got} tokens) taken after the {how} at "
                f"0.1 s")
            overdue = left - due
            assert overdue < 1.5, f"the {how} at 0.1 s took effect {overdue:.2f} s late"
        # Every one was aborted: nothing is left in flight.
        await wait_until(lambda: client.engine.in_flight == 0)


async def _cancel_later(scope: anyio.CancelScope, cancelled_at: list[float]) -> None:
    await anyio.sleep(0.1)
    cancelled_at.append(anyio.current_time())
    scope.cancel()
