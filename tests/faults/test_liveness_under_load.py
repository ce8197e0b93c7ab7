"""Overload cannot fool the liveness check: consumers slower than the engine, for longer
than its timeout, and no request fails.

The engine is a mock process stepping back to back; every stream's consumer spends
``WORK`` seconds (blocking) on each output, so together they read outputs far slower than
the engine makes them, and a backlog of outputs waits in front of anything else the engine
sends, the answer to a liveness question included. Every message read from the engine
proves it alive (docs/reliability.md, "The liveness check"): the streams, which take many
liveness timeouts to read, all end with every token they asked for. The streams are
``per_step``: coalesced (the default), a consumer takes the steps that waited as one output
and keeps up.
"""

from __future__ import annotations

import logging
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
    HealthConfig,
    SamplingParams,
)
from tests.support import mock_engine_process

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

STREAMS = 32
TOKENS = 300
#: Seconds of the consumer's (blocking) work per output: 32 x 300 x 0.3 ms = 2.9 s to read
#: what the engine makes in a fraction of that.
WORK = 0.0003
LIVENESS_TIMEOUT = 0.5


@pytest.fixture
def engine_address() -> Iterator[str]:
    """A mock engine process stepping back to back, dialing this address."""
    with mock_engine_process("--step-time", "0") as address:
        yield address


async def slow_consumers(address: str, liveness_timeout: float, streams: int, tokens: int,
                         work: float) -> float:
    """``streams`` per-step streams of ``tokens`` tokens, each consumer doing ``work``
    seconds of blocking work per output, under a liveness check (interval 0.1 s, timeout
    ``liveness_timeout``); checks that every request ended with every token and no error,
    and that the client is healthy and still answers. Returns the seconds they took."""
    config = ClientConfig(engine=EngineCoreClientConfig(
        transport=HandshakeTransport(address), ready_timeout=20,
        health=HealthConfig(liveness_interval=0.1, liveness_timeout=liveness_timeout)),
        registry=None)
    got: list[int] = []
    errors: list[BaseException] = []
    async with Client.connect(config) as client:

        async def consume(n: int) -> None:
            request = GenerateRequest(request_id=f"slow-{n}", prompt_token_ids=[1, 2, 3],
                                      sampling_params=SamplingParams(max_tokens=tokens,
                                                                     ignore_eos=True))
            count = 0
            try:
                async with client.generate(request, per_step=True) as stream:
                    async for out in stream:
                        count += len(out.token_ids)
                        time.sleep(work)  # noqa: ASYNC251 - a consumer slower than the engine
            except Exception as exc:
                errors.append(exc)
            got.append(count)

        started = anyio.current_time()
        with anyio.fail_after(40):
            async with anyio.create_task_group() as tg:
                for n in range(streams):
                    tg.start_soon(consume, n)
        took = anyio.current_time() - started
        assert errors == [], errors[:3]
        assert got == [tokens] * streams
        assert client.engine.is_healthy, client.engine.health_error
        await client.engine.is_sleeping()  # and it still serves
    return took


async def test_consumers_slower_than_the_engine_never_make_it_look_dead(
        engine_address: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="anyio_genout")
    took = await slow_consumers(engine_address, LIVENESS_TIMEOUT, STREAMS, TOKENS, WORK)
    assert took > 2 * LIVENESS_TIMEOUT, took  # overloaded for several timeouts
    # A question left unanswered because the engine was heard meanwhile: its late answer is
    # expected, not a warning.
    assert [r.getMessage() for r in caplog.records if "utility call" in r.getMessage()] == []


async def test_a_loop_held_up_by_its_consumers_does_not_make_an_idle_engine_look_dead(
        engine_address: str) -> None:
    """The engine has sent everything and is idle, so it is asked; the consumers, each
    doing 2 ms of blocking work per buffered output, make every loop pass about 0.1 s
    long, and the question's send and the answer's read take a pass each. A wall-clock
    timeout of 0.2 s expired before the answer could be read, and the client, its every
    request answered, was left unhealthy for good; the timeout counts only the time the
    loop gave the check."""
    await slow_consumers(engine_address, 0.2, streams=48, tokens=24, work=0.002)
