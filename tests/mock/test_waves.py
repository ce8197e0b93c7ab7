"""The mock's data-parallel wave group on the wire, driven by raw front ends (one per engine,
hand-built frames): a request on a paused group waits in the collective until
START_DP_WAVE wakes the peer, the group pauses together and the lowest rank reports
wave_complete, an excluded engine ignores START_DP_WAVE, and a stale-wave ADD on a paused
engine reports start_wave."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from anyio_genout import (
    EngineCoreClient,
    EngineCoreClientConfig,
    HandshakeTransport,
    SamplingParams,
)
from anyio_genout.mock import MockEngine, MockEngineConfig, greedy_tokens
from anyio_genout.mock.waves import WaveGroup, WaveMember
from anyio_genout.protocol import DpControl, EngineCoreRequest, RequestBatch, decode_outputs
from tests.support import wait_until

from ..cli.support import cli_process, free_port
from .frontend import FrontEnd, pack, running_engine

pytestmark = pytest.mark.anyio

START_DP_WAVE = b"\x02"
PROMPT = [1, 5, 6, 7, 8]


@asynccontextmanager
async def pair() -> AsyncIterator[tuple[WaveGroup, list[tuple[MockEngine, FrontEnd]]]]:
    """Engines 0 and 1 of one wave group, each with its own raw front end."""
    waves = WaveGroup()
    config = MockEngineConfig(handshake_address="tcp://127.0.0.1:1", step_time=0.001)
    async with running_engine(config, waves=waves) as first, \
            running_engine(config, waves=waves, rank=1) as second:
        yield waves, [first, second]


def member(engine: MockEngine) -> WaveMember:
    assert engine.wave is not None
    return engine.wave


async def wave_control(front: FrontEnd) -> DpControl:
    """The next wave-control message (skipping stats and outputs)."""
    while True:
        message = await front.receive(seconds=5)
        if isinstance(message, DpControl):
            return message


async def test_a_request_on_a_paused_group_waits_until_start_dp_wave_wakes_the_peer() -> None:
    async with pair() as (waves, [(e0, f0), (e1, f1)]):
        await f0.add("a", PROMPT, {"temperature": 0.0, "max_tokens": 3})
        quiet = await f0.quiet(seconds=0.3)
        assert not any(isinstance(m, RequestBatch) and m.message.outputs
                       for m in map(decode_outputs, quiet))  # waiting in the collective
        assert member(e0).running and not member(e1).running
        await f1.send(START_DP_WAVE, pack([0, 0]))
        tokens, last = await f0.tokens("a")
        assert len(tokens) == 3 and last.finished
        control = await wave_control(f0)
        assert control.message.wave_complete == 0 and control.message.engine_index == 0
        assert waves.waves_completed == 1
        assert member(e1).dummy_steps >= 1
        assert [member(e).current_wave for e in (e0, e1)] == [1, 1]
        assert not member(e0).running and not member(e1).running
        later = await f1.quiet(seconds=0.1)
        assert not any(isinstance(decode_outputs(m), DpControl) for m in later)


async def test_an_excluded_engine_ignores_start_dp_wave_and_a_stale_one_too() -> None:
    async with pair() as (_waves, [(_e0, _f0), (e1, f1)]):
        await f1.send(START_DP_WAVE, pack([0, 1]))  # excluded
        await wait_until(lambda: member(e1).start_dp_waves == [(0, 1)], 5)
        assert not member(e1).running
        member(e1).current_wave = 3
        await f1.send(START_DP_WAVE, pack([2, None]))  # older than its wave
        await wait_until(lambda: len(member(e1).start_dp_waves) == 2, 5)
        assert not member(e1).running and member(e1).current_wave == 3
        await f1.send(START_DP_WAVE, pack([4, None]))
        await wait_until(lambda: member(e1).running, 5)
        assert member(e1).current_wave == 4 and not e1.errors


async def test_a_stale_wave_add_on_a_paused_engine_reports_start_wave() -> None:
    async with pair() as (waves, [(_e0, f0), (e1, f1)]):
        await f1.send(START_DP_WAVE, pack([0, None]))
        await f0.send(START_DP_WAVE, pack([0, None]))  # an idle wave: dummy steps only
        await wait_until(lambda: waves.waves_completed == 1, 5)
        await f1.add("b", PROMPT, {"temperature": 0.0, "max_tokens": 2})  # current_wave 0
        control = await wave_control(f1)
        assert (control.message.start_wave, control.message.engine_index) == (1, 1)
        assert member(e1).start_waves_sent == [1]
        await f0.send(START_DP_WAVE, pack([1, 1]))  # what a front end does with it
        tokens, _ = await f1.tokens("b")
        assert len(tokens) == 2


async def test_a_malformed_start_dp_wave_is_an_error_and_changes_nothing() -> None:
    async with pair() as (_waves, [(_e0, _f0), (e1, f1)]):
        await f1.send(START_DP_WAVE, pack(["zero", None]))
        await wait_until(lambda: e1.errors, 5)
        assert "START_DP_WAVE: expected [wave, exclude]" in e1.errors[0]
        assert not member(e1).running and member(e1).start_dp_waves == []


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_cli_runs_a_wave_group_that_a_client_following_waves_can_drive() -> None:
    """``anyio-genout mock-engine --dp-wave-group 2``: two engines, one process, one group."""
    address = f"tcp://127.0.0.1:{free_port()}"
    async with cli_process("mock-engine", "--handshake-address", address,
                           "--dp-wave-group", "2", "--step-time", "0.001",
                           "--once") as (process, output):
        config = EngineCoreClientConfig(transport=HandshakeTransport(address), engine_count=2,
                                        data_parallel_waves=True)
        with anyio.fail_after(20):
            async with EngineCoreClient.connect(config) as client:
                for rid, rank, wave in (("a", 0, 0), ("b", 1, 1)):
                    request = EngineCoreRequest(
                        request_id=rid, prompt_token_ids=[1, 2, 3], arrival_time=0.0,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
                        data_parallel_rank=rank)
                    async with client.call(request) as stream:
                        tokens = [t async for item in stream for t in item.output.new_token_ids]
                    assert tokens == greedy_tokens([1, 2, 3], 4)
                    assert stream.request.current_wave == wave
                    paused = (wave + 1, False)
                    await wait_until(lambda: client.wave_state == paused, 5)  # noqa: B023
            assert await process.wait() == 0
    assert "a wave group of 2 engines" in output.err and "Traceback" not in output.err
