"""Engine death without a sentinel: a silent engine, found by the liveness check.

``MockFaults.silent_after_steps`` makes the mock stop reading input and stop stepping while
its sockets stay connected, as a real engine whose input thread died (vLLM does that after
a malformed input message). Nothing arrives, nothing is refused, no connection closes:
only a deadline can tell. The check is on by default; these tests shorten its timings.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from anyio_genout import EngineCoreClientConfig, EngineDeadError, HealthConfig
from anyio_genout.mock import MockFaults
from anyio_genout.protocol import UtilityRequest
from tests.cluster import mock_cluster
from tests.support import wait_until

from .support import drain, engine_request

pytestmark = pytest.mark.anyio

LIVENESS: dict[str, Any] = {"health": HealthConfig(liveness_interval=0.2, liveness_timeout=0.5)}


async def test_silent_engine_is_detected_and_streams_fail() -> None:
    async with mock_cluster(faults=MockFaults(silent_after_steps=3), **LIVENESS) as cluster:
        client = cluster.client
        errors: list[BaseException | None] = []
        silent_at: list[float] = []

        async def one(i: int) -> None:
            async with client.call(engine_request(f"r{i}", max_tokens=1000)) as stream:
                errors.append((await drain(stream))[1])

        async def note_silence() -> None:
            await wait_until(lambda: cluster.engine.silent)
            silent_at.append(time.monotonic())

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(note_silence)
                for i in range(10):
                    tg.start_soon(one, i)
        detected = time.monotonic() - silent_at[0]
        assert detected < 0.2 + 0.5 + 2.5  # interval + timeout + slack for a loaded machine
        assert len(errors) == 10 and all(isinstance(e, EngineDeadError) for e in errors)
        error = client.health_error
        assert isinstance(error, EngineDeadError)
        assert "engine 0" in str(error) and "liveness" in str(error)
        with anyio.fail_after(1), pytest.raises(EngineDeadError):
            await client.is_sleeping()
        assert client.in_flight == 0 and client.pending_utility_calls == 0


async def test_the_silent_engine_is_named_among_two() -> None:
    faults = [MockFaults(), MockFaults(silent_after_steps=2)]
    async with mock_cluster(2, faults=faults, **LIVENESS) as cluster:
        client = cluster.client
        async with client.call(engine_request("a", max_tokens=1000, data_parallel_rank=1)) \
                as stream:
            with anyio.fail_after(5):
                _, error = await drain(stream)
        assert isinstance(error, EngineDeadError) and "engine 1" in str(error)
        assert not cluster.engines[0].silent


async def test_waiting_utility_call_fails_when_the_engine_goes_silent() -> None:
    async with mock_cluster(faults=MockFaults(silent_after_steps=1), **LIVENESS) as cluster:
        client = cluster.client
        async with client.call(engine_request("a", max_tokens=1000)):
            await wait_until(lambda: cluster.engine.silent)
            with anyio.fail_after(5), pytest.raises(EngineDeadError):
                await client.get_supported_tasks()


@pytest.mark.usefixtures("frozen_heap")
async def test_live_engine_under_load_is_not_flagged() -> None:
    """An engine that streams (steps of 10 ms, for about 3 s: several check intervals)
    proves itself alive with every output and is never asked; once idle it is asked again.

    The check looks every half interval whether anything arrived since its last look, and a
    stall of the whole process (engine, reader and check share this loop) longer than that
    makes it ask a live engine: with a 1 s interval only a stall of more than 0.5 s could
    (the heap is frozen, so no full collection of earlier tests' objects falls in here)."""
    health = HealthConfig(liveness_interval=1.0, liveness_timeout=0.5)
    async with mock_cluster(mock={"step_time": 0.01}, health=health) as cluster:
        client = cluster.client
        finished = 0

        async def one(i: int) -> None:
            nonlocal finished
            async with client.call(engine_request(f"r{i}", max_tokens=300)) as stream:
                items, error = await drain(stream)
                assert error is None and items[-1].output.finished
                finished += 1

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(one, i)
        assert finished == 20 and client.is_healthy
        pings = [r for r in cluster.engine.received if isinstance(r, UtilityRequest)]
        assert pings == []  # every output counted as proof of life
        await wait_until(lambda: any(isinstance(r, UtilityRequest)
                                     for r in cluster.engine.received))
        pings = [r for r in cluster.engine.received if isinstance(r, UtilityRequest)]
        assert {p.method for p in pings} == {"is_sleeping"} and client.is_healthy
        await wait_until(lambda: client.pending_utility_calls == 0)


async def test_the_check_is_on_by_default_and_can_be_turned_off() -> None:
    """On by default, with a timeout well above the longest engine step measured
    (docs/reliability.md). ``liveness_interval=None`` turns it off: the client then cannot
    tell silence from a slow engine; callers' own timeouts still work, and leaving the scope
    still cleans up."""
    defaults = EngineCoreClientConfig().health
    assert defaults.liveness_interval == 10.0 and defaults.liveness_timeout == 60.0
    async with mock_cluster(faults=MockFaults(silent_after_steps=2),
                            health=HealthConfig(liveness_interval=None)) as cluster:
        client = cluster.client
        with anyio.move_on_after(0.5) as scope:
            async with client.call(engine_request("a", max_tokens=1000)) as stream:
                await drain(stream)
        assert scope.cancelled_caught
        assert cluster.engine.silent and client.is_healthy
        assert client.in_flight == 0
        assert not [r for r in cluster.engine.received if isinstance(r, UtilityRequest)]
