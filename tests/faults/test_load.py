"""Load: 10,000 concurrent requests, a cancellation storm, and a stalled consumer.

Nothing is lost: every request ends with its terminal output, exactly one error, or the
caller's own cancellation; every registry and tracking map is empty afterwards; every abort
is sent exactly once; vllm:request_success_total counts each request exactly once.
"""

from __future__ import annotations

import random
import time

import anyio
import anyio.lowlevel
import pytest

from anyio_genout import GenerateOutput
from anyio_genout.mock import MockFaults
from tests.cluster import generate_client
from tests.support import wait_until

from .support import drain, generate_request, success_total

pytestmark = pytest.mark.anyio

FAST_MOCK = {"max_num_seqs": 1024, "keep_history": False}


@pytest.mark.slow
async def test_10000_concurrent_requests_all_complete() -> None:
    n = 10_000
    async with generate_client(mock=FAST_MOCK) as (client, cluster):
        tokens: list[int] = []

        async def one(i: int) -> None:
            async with client.generate(generate_request(f"r{i}", max_tokens=4,
                                                        prompt=[i % 500 + 1])) as stream:
                outs, error = await drain(stream)
            assert error is None
            final = outs[-1].finish_reason
            assert final is not None and final.as_str() == "length"
            tokens.append(sum(len(o.token_ids) for o in outs))

        started = time.monotonic()
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
        elapsed = time.monotonic() - started
        assert tokens == [4] * n, elapsed
        assert cluster.client.in_flight == 0 and len(client.inflight) == 0
        assert cluster.client.aborts_sent == 0
        assert success_total(client) == {"length": n}
        assert cluster.client.is_healthy


async def cancellation_storm(n: int, seed: int, *, engines: int = 1,
                             faults: MockFaults | None = None) -> None:
    """``n`` requests, each cancelled at a random point (some finish first)."""
    rng = random.Random(seed)
    async with generate_client(engines, faults=faults,
                               mock={"max_num_seqs": 256}) as (client, cluster):
        raw = cluster.client
        expect_abort: set[str] = set()
        finished: set[str] = set()
        cancelled: set[str] = set()
        sent = 0

        async def one(i: int) -> None:
            nonlocal sent
            how = rng.choice(["time", "count", "cancel", "raise"])
            after = rng.randint(0, 12)
            request = generate_request(f"s{i}", max_tokens=rng.randint(1, 12))
            with anyio.move_on_after(rng.random() * 0.05 if how == "time" else 60):
                try:
                    async with client.generate(request) as stream:
                        sent += 1
                        rid = stream.request_id
                        try:
                            seen = 0
                            async for out in stream:
                                if out.finish_reason is not None:
                                    finished.add(rid)
                                seen += 1
                                if seen >= after and how == "cancel":
                                    if rid in raw._registry.requests:  # cancel() aborts now
                                        expect_abort.add(rid)
                                    stream.cancel()
                                    await anyio.lowlevel.checkpoint()
                                if seen >= after and how == "raise":
                                    raise LookupError("the caller gave up")
                                if seen >= after and how == "count":
                                    break
                        finally:
                            # Still registered = the client never saw its terminal output:
                            # leaving now must abort it, exactly once.
                            if rid in raw._registry.requests:
                                expect_abort.add(rid)
                            elif rid not in finished and rid not in expect_abort:
                                cancelled.add(rid)  # terminal was buffered, not consumed
                except LookupError:
                    pass

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
                    if i % 100 == 0:
                        await anyio.lowlevel.checkpoint()
            # The abort worker may still hold the last batch: wait for it to be sent and read.
            await wait_until(lambda: raw.aborts_sent >= len(expect_abort) and sum(
                len(e.aborted_ids) for e in cluster.engines) >= raw.aborts_sent, 10)
        aborted = [rid for e in cluster.engines for rid in e.aborted_ids]
        assert len(aborted) == len(set(aborted)), "an abort was sent twice"
        assert set(aborted) == expect_abort
        assert raw.aborts_sent == len(aborted)
        assert raw.in_flight == 0 and len(client.inflight) == 0
        assert raw.pending_utility_calls == 0
        counts = success_total(client)
        # A request whose random deadline passed before its task even started was never
        # sent (and is not counted); on a loaded machine that happens, and is fine.
        assert sum(counts.values()) == sent, counts
        assert sent > n // 2
        assert counts.get("abort", 0) == len(expect_abort) + len(cancelled)
        assert raw.is_healthy
        # The storm really stormed: every way of leaving happened.
        assert len(expect_abort) > n // 10 and len(finished) > n // 10, (
            len(expect_abort), len(finished), len(cancelled))
        for engine in cluster.engines:
            assert not engine.dead and engine.errors == []
        await wait_until(lambda: not any(e.running_ids or e.waiting_ids
                                         for e in cluster.engines))


async def test_cancellation_storm_leaves_nothing_behind() -> None:
    await cancellation_storm(2000, seed=1)


async def test_cancellation_storm_on_two_engines_with_preemption_and_late_outputs() -> None:
    await cancellation_storm(1000, seed=2, engines=2,
                             faults=MockFaults(preempt_every=3, late_outputs_after_abort=2))


async def test_a_stalled_consumer_does_not_slow_the_others() -> None:
    """One consumer reads nothing until all 300 others are done; they finish regardless,
    and the stalled stream still gets every token, in order, afterwards."""
    async with generate_client(mock={"max_num_seqs": 512}) as (client, cluster):
        others_done = anyio.Event()
        finished = 0

        async def other(i: int) -> None:
            nonlocal finished
            async with client.generate(generate_request(f"o{i}", max_tokens=50)) as stream:
                outs, error = await drain(stream)
            assert error is None and outs[-1].finish_reason is not None
            finished += 1
            if finished == 300:
                others_done.set()

        stalled_outs: list[GenerateOutput] = []

        async def stalled() -> None:
            async with client.generate(generate_request("stalled", max_tokens=200)) as stream:
                await others_done.wait()  # reads nothing meanwhile
                stalled_outs.extend((await drain(stream))[0])

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stalled)
                await anyio.lowlevel.checkpoint()
                for i in range(300):
                    tg.start_soon(other, i)
        assert finished == 300
        tokens = [t for o in stalled_outs for t in o.token_ids]
        assert len(tokens) == 200 and stalled_outs[-1].finish_reason is not None
        assert cluster.client.in_flight == 0


async def test_a_slow_consumer_does_not_delay_a_fast_one() -> None:
    """A consumer that sleeps 20 ms per engine step (``per_step``: coalesced, it would catch
    up with merged outputs) next to one that keeps up: the fast one finishes in the engine's
    time, not the slow one's."""
    async with generate_client(mock={"step_time": 0.002}) as (client, _):
        done: dict[str, float] = {}

        async def consume(name: str, pause: float) -> None:
            started = time.monotonic()
            async with client.generate(generate_request(name, max_tokens=50),
                                       per_step=True) as stream:
                async for _ in stream:
                    if pause:
                        await anyio.sleep(pause)
            done[name] = time.monotonic() - started

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume, "slow", 0.02)
                tg.start_soon(consume, "fast", 0.0)
        assert done["fast"] < done["slow"] / 2, done
