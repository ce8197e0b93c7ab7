"""Data-parallel waves through the real client and a mock data-parallel MoE group over real
ZeroMQ (mock/waves.py: the engines step only while all of them run, and pause together when
none has work): the first request wakes the other engines, requests carry the group's
wave, a completed wave pauses the group and the next request starts the next wave without
waking its own engine, an engine's start_wave is followed and rebroadcast. Without the
client's wake-up a request on a paused group waits in the collective forever, so every
wait here is bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from anyio_genout import EngineCoreClient, SamplingParams
from anyio_genout.mock import MockEngine
from anyio_genout.mock.waves import WaveGroup, WaveMember
from anyio_genout.protocol import AddRequest, EngineCoreRequest
from tests.cluster import mock_cluster
from tests.support import wait_until

pytestmark = pytest.mark.anyio


def req(rid: str, rank: int | None = None, max_tokens: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                             sampling_params=SamplingParams(temperature=0.0,
                                                            max_tokens=max_tokens),
                             arrival_time=0.0, data_parallel_rank=rank)


@asynccontextmanager
async def group(engines: int = 2) -> AsyncIterator[
        tuple[EngineCoreClient, list[MockEngine], WaveGroup]]:
    """``engines`` mock engines in one wave group and a client following waves."""
    waves = WaveGroup()
    async with mock_cluster(engines, waves=waves, mock={"step_time": 0.001},
                            data_parallel_waves=True) as cluster:
        yield cluster.client, cluster.engines, waves


def member(engine: MockEngine) -> WaveMember:
    assert engine.wave is not None
    return engine.wave


def after_the_wake_ups(engine: MockEngine, count: int) -> list[tuple[int, int | None]]:
    """START_DP_WAVE messages after the first ``count`` other than the client's wake-up of
    every engine after a wave that ended with requests unfinished (the group's
    ``wave_complete`` comes from engine 0 and may overtake engine 1's last output)."""
    return [s for s in member(engine).start_dp_waves[count:] if s[1] is not None]


def added_waves(engine: MockEngine) -> list[tuple[str, int]]:
    return [(r.request.request_id, r.request.current_wave) for r in engine.received
            if isinstance(r, AddRequest)]


async def finish(client: EngineCoreClient, request: EngineCoreRequest) -> int:
    """Run ``request`` to its end (bounded); the number of outputs."""
    count = 0
    with anyio.fail_after(5):
        async with client.call(request) as stream:
            async for _ in stream:
                count += 1
    return count


async def test_the_first_request_wakes_the_other_engines_and_the_group_then_pauses() -> None:
    async with group() as (client, (e0, e1), waves):
        # 100 steps (0.1 s at least) give e1, woken, time to step with nothing to do: the
        # mock's collective lets e0 step while every engine runs, not step for step, so a
        # 3-step request on a loaded machine ended the wave before e1's loop had a turn.
        assert await finish(client, req("a", rank=0, max_tokens=100)) >= 1
        # The wake-up is sent with the ADD, but a loaded machine may deliver it after the
        # request's last output: wait for it, then check it came once.
        await wait_until(lambda: member(e1).start_dp_waves and member(e0).start_dp_waves, 5)
        assert member(e1).start_dp_waves == [(0, 0)]  # woken, the target excluded
        assert member(e0).start_dp_waves == [(0, 0)]  # (a broadcast: e0 ignores it)
        await wait_until(lambda: member(e1).dummy_steps >= 1, 5)  # stepped with nothing to do
        assert added_waves(e0) == [("a", 0)]
        await wait_until(lambda: waves.waves_completed == 1, 5)
        assert not member(e0).running and not member(e1).running
        await wait_until(lambda: client.wave_state == (1, False), 5)


async def test_after_a_pause_the_next_request_carries_the_next_wave() -> None:
    async with group() as (client, (e0, e1), waves):
        await finish(client, req("a", rank=0))
        await wait_until(lambda: client.wave_state == (1, False), 5)
        await finish(client, req("b", rank=1))
        assert added_waves(e1) == [("b", 1)]
        assert member(e0).start_dp_waves[:2] == [(0, 0), (1, 1)]  # woken for wave 1
        assert not after_the_wake_ups(e0, 2)
        await wait_until(lambda: waves.waves_completed >= 2 and client.wave_state is not None
                         and not client.wave_state[1], 5)
        state = client.wave_state
        assert state is not None and member(e0).current_wave == member(e1).current_wave == state[0]


async def test_requests_while_the_group_runs_send_no_second_wakeup() -> None:
    async with group() as (client, (e0, e1), _waves):
        counts: list[int] = []

        async def run(request: EngineCoreRequest) -> None:
            counts.append(await finish(client, request))

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(run, req(f"r{i}", max_tokens=20))
        assert len(counts) == 6
        assert member(e0).start_dp_waves == member(e1).start_dp_waves
        first = [s for s in member(e0).start_dp_waves if s[1] is not None]
        assert len(first) == 1  # one wake-up for the wave, by its first request
        assert {w for e in (e0, e1) for _, w in added_waves(e)} == {0}
        assert added_waves(e0) and added_waves(e1)  # spread over both engines


async def test_an_engines_start_wave_is_followed_and_rebroadcast_without_it() -> None:
    async with group() as (client, (e0, e1), waves):
        await finish(client, req("a", rank=0))
        await wait_until(lambda: waves.waves_completed == 1, 5)
        await wait_until(lambda: client.wave_state == (1, False), 5)
        # Engine 1 gets an ADD of the completed wave 0 while paused (one sent by another
        # front end that had not yet heard of the pause): it runs and says start_wave(1).
        member(e1).add(0)
        assert member(e1).start_waves_sent == [1]
        await wait_until(lambda: (1, 1) in member(e0).start_dp_waves, 5)
        # The group ran wave 1 (dummy steps) and paused again; the client followed.
        await wait_until(lambda: waves.waves_completed == 2, 5)
        await wait_until(lambda: client.wave_state == (2, False), 5)
        assert client.is_healthy
        assert await finish(client, req("b", rank=1)) >= 1
        assert added_waves(e1) == [("b", 2)]
        assert member(e0).start_dp_waves[:3] == [(0, 0), (1, 1), (2, 1)]
        assert not after_the_wake_ups(e0, 3)
