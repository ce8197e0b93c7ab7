"""Every engine dies (issue 22, item 4): with ``last_engine_death="wait"`` the client stays
healthy with no engine up, fails every request and utility call at once naming the engines
down, and takes a restarted engine back (handshake owner and bootstrapped); with the default
``"fail"`` the client fails as a whole, and a restarted engine is refused saying so (it used
to be refused as "engine 0 is up", although the log had declared it dead).

Mock engines in this event loop (``tests/cluster.py``'s, with
``tests/faults/test_rejoin.py``'s settings); the CLI's ``serve`` over engine processes
killed with SIGKILL is in ``tests/server/test_serve_lifecycle.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

from anyio_genout import EngineDeadError, HandshakeTimeoutError, HealthConfig
from tests.cluster import generate_client
from tests.faults.test_rejoin import settings, stream
from tests.support import wait_until

pytestmark = pytest.mark.anyio

WAIT: dict[str, Any] = {"last_engine_death": "wait"}


@pytest.mark.parametrize("way", ["sentinel", "sockets closed"])
async def test_every_engine_dead_then_one_restarted_serves_again(way: str) -> None:
    async with generate_client(**settings(2, health=WAIT)) as (_, c):
        engine = c.client
        for rank in (0, 1):  # the client learns which connection is whose
            assert (await stream(c.front, f"first{rank}", rank=rank))[0] == rank
        for rank in (0, 1):
            await c.kill(rank, way)
        # Healthy, engineless: a request and a utility call fail at once, naming both.
        assert engine.is_healthy and engine.health_error is None
        assert engine.live_engines == []
        assert set(engine.engine_health) == {0, 1}
        assert all(why is not None for why in engine.engine_health.values())
        with anyio.fail_after(1), pytest.raises(EngineDeadError) as refused:
            await stream(c.front, "nobody")
        message = str(refused.value)
        assert message.startswith("every engine is down (engine 0")
        assert "engine 1" in message and refused.value.ranks == (0, 1)
        with anyio.fail_after(1), pytest.raises(EngineDeadError, match="every engine is down"):
            await engine.call_utility("is_sleeping")
        assert c.health == [(0, False), (1, False)]

        new = await c.restart(1)
        assert engine.live_engines == [1]
        ran_on, tokens = await stream(c.front, "back")
        assert ran_on == 1 and len(tokens) == 8
        assert any(rid.startswith("back") for rid in new.added_ids)
        assert await engine.call_utility("is_sleeping") == [False]
        await c.restart(0)
        assert engine.live_engines == [0, 1]
        assert c.health[-2:] == [(1, True), (0, True)]
        assert engine.in_flight == 0 and engine.pending_utility_calls == 0


async def test_one_engine_dies_and_comes_back_three_times() -> None:
    async with generate_client(**settings(1, health=WAIT)) as (_, c):
        for round_ in range(3):
            await c.kill(0, "sockets closed")
            assert c.client.is_healthy and c.client.live_engines == []
            await c.restart(0)
            assert (await stream(c.front, f"round{round_}"))[0] == 0
        assert c.client.in_flight == 0


async def test_a_bootstrapped_client_takes_back_its_only_engine() -> None:
    async with generate_client(**settings(1, bootstrapped=True, health=WAIT)) as (_, c):
        await c.kill(0, "sockets closed")
        assert c.client.is_healthy and c.client.live_engines == []
        await c.restart(0)
        assert (await stream(c.front, "again"))[0] == 0


async def test_a_failed_client_refuses_a_restart_saying_why(
        caplog: pytest.LogCaptureFixture) -> None:
    """The default: the last death fails the client; the restarted engine's HELLO is
    refused because the client failed, not because "engine 0 is up"."""
    async with generate_client(**settings(1)) as (_, c):
        c.engines[0].die("killed by the test")
        await wait_until(lambda: not c.client.is_healthy, 5)
        c.scopes[0].cancel()
        restarted = c.new_engine(0, handshake_timeout=0.5)
        with (caplog.at_level(logging.WARNING, "anyio_genout.engine"), anyio.fail_after(5),
              pytest.raises(HandshakeTimeoutError)):
            await restarted.serve()  # no INIT comes
    assert "refusing a HELLO from engine 0: the client failed as a whole" in caplog.text
    assert "engine 0 is up" not in caplog.text


def test_waiting_needs_per_engine_failure() -> None:
    with pytest.raises(ValueError, match='last_engine_death="wait" needs engine_failure'):
        HealthConfig(last_engine_death="wait", engine_failure="client")
    with pytest.raises(ValueError, match="last_engine_death must be one of 'fail', 'wait'"):
        HealthConfig(last_engine_death="later")  # type: ignore[arg-type]
