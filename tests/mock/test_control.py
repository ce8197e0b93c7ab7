"""Utility calls, aborts, fatal conditions and fault injection."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from anyio_genout.errors import ProtocolError
from anyio_genout.mock import MockFaults, greedy_tokens
from anyio_genout.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreEventType,
    EngineCoreFinishReason,
    EngineCoreOutputs,
    RequestBatch,
    UtilityReply,
    decode_outputs,
)
from tests.support import wait_until

from .frontend import ADD, UTILITY, pack, running_engine, unpack

pytestmark = pytest.mark.anyio

WIRE = Path(__file__).resolve().parent.parent / "data" / "vllm-wire"
PROMPT = [1, 5, 6, 7, 8]


def golden(name: str) -> Any:
    return unpack((WIRE / f"{name}.frame0.bin").read_bytes())


def greedy(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": max_tokens, **extra}


# ---------------------------------------------------------------- utility calls


async def test_utility_replies_match_vllm() -> None:
    ok, fail = golden("e023_output_utility"), golden("e024_output_utility_fail")
    async with running_engine() as (engine, front):
        await front.send(UTILITY, pack([0, 964922981770727921, "get_supported_tasks", []]))
        ours_ok = unpack((await front.receive_raw())[0])
        await front.send(UTILITY, pack([0, 12345, "no_such_method", []]))
        ours_fail = unpack((await front.receive_raw())[0])
        assert len(engine.received) == 2 and engine.errors == []
    for ours, theirs in ((ours_ok, ok), (ours_fail, fail)):
        assert isinstance(ours[3], float)
        ours[3] = theirs[3]
        assert ours == theirs


async def test_utility_methods() -> None:
    async with running_engine(rank=2, bootstrapped=True) as (engine, front):
        front.identity = b"\x02\x00"

        async def call(method: str, *args: Any) -> Any:
            reply = await front.utility(method, *args)
            assert reply.failure_message is None, reply.failure_message
            return reply.result

        assert await call("is_sleeping") is False
        assert await call("list_loras") == []
        assert await call("collective_rpc", "echo") == ["engine-2-worker"]
        assert await call("reset_prefix_cache") is True
        assert await call("reset_mm_cache") is None
        assert await call("reset_encoder_cache") is None
        assert await call("get_weight_version") == "default"
        assert await call("set_weight_version", "v2") is None
        await front.add("w", PROMPT, greedy(1))
        assert (await front.collect("w"))["w"]
        assert engine.weight_version == "v2"

        assert await call("sleep", 1) is None
        assert await call("is_sleeping") is True
        assert await call("wake_up", ["scheduling"]) is False  # weights still asleep
        assert await call("is_sleeping") is True
        assert await call("wake_up") is True
        assert await call("is_sleeping") is False
        assert await call("sleep", 0) is None
        assert await call("is_scheduler_paused") is True
        assert await call("wake_up", ["scheduling"]) is True
        assert await call("is_scheduler_paused") is False

        bad = await front.utility("pause_scheduler", "bogus")
        assert bad.failure_message == "Call to pause_scheduler method failed: Invalid pause " \
                                      "mode: bogus"
        wrong = await front.utility("is_sleeping", 1, 2)
        assert wrong.failure_message.startswith("Call to is_sleeping method failed: ")
        private = await front.utility("_die", "x")
        assert private.failure_message == ("Call to _die method failed: 'EngineCoreProc' "
                                           "object has no attribute '_die'")
        assert not engine.dead


async def test_pause_modes() -> None:
    async with running_engine(step_time=0.005) as (engine, front):
        # keep: nothing steps until resumed, the request survives
        await front.add("k", PROMPT, greedy(40))
        await wait_until(lambda: engine.steps > 0)
        assert (await front.utility("pause_scheduler", "keep", False)).result is None
        steps = engine.steps
        await anyio.sleep(0.05)
        assert engine.steps == steps and engine.running_ids == ["k"]
        await front.add("queued", PROMPT, greedy(2))
        await front.utility("resume_scheduler")
        got = await front.collect("k", "queued")
        assert sum(len(o.new_token_ids) for o in got["queued"]) == 2

        # wait: the reply comes once running requests drained; new ones stay queued
        await front.add("w", PROMPT, greedy(10))
        await wait_until(lambda: engine.running_ids == ["w"])
        call_id = await front.call("pause_scheduler", "wait")
        await front.add("later", PROMPT, greedy(2))
        seen_finish = False
        with anyio.fail_after(5):
            while True:
                message = await front.receive()
                if isinstance(message, UtilityReply):
                    assert message.reply.call_id == call_id and seen_finish
                    break
                assert isinstance(message, RequestBatch)
                seen_finish |= any(o.finished for o in message.message.outputs
                                   if o.request_id == "w")
        assert engine.waiting_ids == ["later"] and engine.running_ids == []

        # abort: every request finishes with ABORT and finished_requests
        await front.utility("resume_scheduler")
        await wait_until(lambda: "later" not in engine.waiting_ids)
        await front.add("a", PROMPT, greedy(1000))
        await wait_until(lambda: engine.running_ids == ["a"])
        call_id = await front.call("pause_scheduler", "abort")
        with anyio.fail_after(5):
            while True:
                message = await front.receive()
                if isinstance(message, RequestBatch) and message.message.finished_requests:
                    assert message.message.finished_requests == frozenset({"a"})
                    (out,) = message.message.outputs
                    assert out.finish_reason == EngineCoreFinishReason.ABORT
                    assert out.new_token_ids == []
                    break
        reply = await front.receive()
        while not isinstance(reply, UtilityReply):
            reply = await front.receive()
        assert reply.reply.call_id == call_id and engine.paused


async def test_reset_prefix_cache_with_running_requests() -> None:
    async with running_engine(step_time=0.005) as (engine, front):
        await front.add("r", PROMPT, greedy(1000))
        await wait_until(lambda: engine.steps > 2)
        assert (await front.utility("reset_prefix_cache")).result is False
        assert (await front.utility("reset_prefix_cache", True)).result is True
        with anyio.fail_after(5):
            while True:  # preempted and rescheduled
                message = await front.receive()
                if isinstance(message, RequestBatch) and message.message.outputs:
                    events = message.message.outputs[0].events
                    if events:
                        assert [e.type for e in events] == [EngineCoreEventType.PREEMPTED,
                                                            EngineCoreEventType.SCHEDULED]
                        break


# ---------------------------------------------------------------- aborts


async def test_abort_is_silent_and_idempotent() -> None:
    async with running_engine(step_time=0.01) as (engine, front):
        await front.add("long", PROMPT, greedy(1000))
        await front.add("other", [9, 9], greedy(1000))
        for _ in range(3):
            await front.receive_rows_raw()
        await front.abort("long")
        await front.abort("long", "unknown")
        await wait_until(lambda: engine.abort_frames == 2)
        cutoff = time.monotonic()
        await front.abort("other")
        await wait_until(lambda: engine.abort_frames == 3)
        messages: list[list[bytes]] = []
        with anyio.fail_after(5):  # up to the stats-only message the last abort owes
            while not messages or _batch(messages[-1]).outputs:
                messages.append(await front.receive_raw())
        messages += await front.quiet(seconds=0.15)  # and nothing after it
        assert engine.aborted_ids == ["long", "long", "unknown", "other"]
        assert engine.running_ids == [] and engine.errors == []
    for frames in messages:
        message = decode_outputs(frames)
        assert isinstance(message, RequestBatch)
        if message.message.timestamp > cutoff:
            assert all(o.request_id != "long" for o in message.message.outputs)
        assert all(not o.finished for o in message.message.outputs)
    last = decode_outputs(messages[-1])
    assert isinstance(last, RequestBatch) and last.message.outputs == []  # stats only
    assert last.message.scheduler_stats is not None
    assert last.message.scheduler_stats.num_running_reqs == 0


async def test_abort_waiting_request() -> None:
    async with running_engine(max_num_seqs=1, step_time=0.01) as (engine, front):
        await front.add("runs", PROMPT, greedy(50))
        await front.add("waits", PROMPT, greedy(5))
        await wait_until(lambda: engine.waiting_ids == ["waits"])
        await front.abort("waits")
        got = await front.collect("runs")
        await anyio.sleep(0.05)
        assert engine.waiting_ids == [] and engine.added_ids == ["runs", "waits"]
        assert len(got["runs"]) == 50


# ---------------------------------------------------------------- fatal conditions


async def test_duplicate_in_flight_id_kills_the_engine() -> None:
    async with running_engine(step_time=0.005) as (engine, front):
        await front.add("dup", [1, 2, 3], greedy(1000))
        await front.receive_rows_raw()
        await front.add("dup", [1, 2, 3], greedy(10))
        with anyio.fail_after(5):
            while await front.receive_raw() != [ENGINE_CORE_DEAD]:
                pass
        await wait_until(lambda: engine.dead)
        assert "duplicate request id" in engine.errors[-1]
        assert await front.quiet(seconds=0.1) == []


@pytest.mark.parametrize("field", ["prompt", "stop"])
async def test_out_of_vocabulary_token_kills_the_engine(field: str) -> None:
    async with running_engine(vocab_size=1024, n_outputs=2) as (engine, front):
        if field == "prompt":
            await front.add("oov", [1, 50000], greedy(4))
        else:
            await front.add("oov", [1, 2], greedy(4, stop_token_ids=[5000]))
        assert await front.receive_raw(0) == [ENGINE_CORE_DEAD]
        assert await front.receive_raw(1) == [ENGINE_CORE_DEAD]  # on every output socket
        assert engine.dead and "out of vocabulary" in engine.errors[-1]


async def test_malformed_add_makes_the_engine_deaf() -> None:
    async with running_engine(step_time=0.005) as (engine, front):
        await front.add("alive", PROMPT, greedy(30))
        await front.send(ADD, pack(["bad", ["1", "5"], None, {}, None, 0.0, None, None,
                                    None]))
        await front.call("is_sleeping")
        # the running request still finishes: only the input thread died
        tokens, last = await front.tokens("alive")
        assert len(tokens) == 30 and last.finished
        messages = await front.quiet(seconds=0.5)
        assert not any(isinstance(decode_outputs(m), UtilityReply) for m in messages)
        assert engine.deaf and not engine.dead
        assert "prompt_token_ids" in engine.errors[0]
        assert [type(r).__name__ for r in engine.received] == ["AddRequest"]


async def test_other_malformed_messages() -> None:
    async with running_engine() as (engine, front):
        await front.send(b"\x02", pack([1, None]))  # START_DP_WAVE: logged and ignored
        await front.send(b"\x05", b"")  # WAKEUP: ignored
        assert (await front.utility("is_sleeping")).result is False
        await front.add("nil", PROMPT, {"max_tokens": None})  # request-scoped ERROR
        message = await front.receive()
        assert isinstance(message, RequestBatch)
        assert message.message.finished_requests == frozenset({"nil"})
        assert message.message.outputs[0].finish_reason == EngineCoreFinishReason.ERROR
        await front.add("x", PROMPT, greedy(2, _all_stop_token_ids=["a"]))
        await wait_until(lambda: engine.deaf)
        assert engine.deaf and "_all_stop_token_ids" in engine.errors[-1]
    async with running_engine() as (engine, front):
        await front.send(b"\x04", b"")  # EXECUTOR_FAILED from outside: fatal
        assert await front.receive_raw() == [ENGINE_CORE_DEAD]


# ---------------------------------------------------------------- faults


async def test_dead_after_steps() -> None:
    async with running_engine(faults=MockFaults(dead_after_steps=3)) as (engine, front):
        await front.add("a", PROMPT, greedy(10))
        rows = [await front.receive_raw() for _ in range(4)]
        assert rows[-1] == [ENGINE_CORE_DEAD]
        assert all(unpack(r[0])[1][0][0] == "a" for r in rows[:3])
        assert engine.dead and engine.steps == 3


async def test_silent_after_steps() -> None:
    async with running_engine(faults=MockFaults(silent_after_steps=2)) as (engine, front):
        await front.add("a", PROMPT, greedy(10))
        await front.receive_raw()
        await front.receive_raw()
        await front.call("is_sleeping")
        assert await front.quiet(seconds=0.3) == []
        assert engine.silent and engine.steps == 2 and not engine.dead


async def test_garbage_after_steps() -> None:
    async with running_engine(faults=MockFaults(garbage_after_steps=1)) as (engine, front):
        await front.add("a", PROMPT, greedy(3))
        await front.receive_raw()
        garbage = await front.receive_raw()
        assert garbage == [b"\xc1"]
        with pytest.raises(ProtocolError):
            decode_outputs(garbage)
        tokens, _ = await front.tokens("a")
        assert len(tokens) == 2 and not engine.dead


async def test_late_outputs_after_abort() -> None:
    faults = MockFaults(late_outputs_after_abort=2)
    # paced steps: "a" needs 5 s to finish, so it is still running when the pause lands
    async with running_engine(faults=faults, step_time=0.005) as (engine, front):
        await front.add("a", PROMPT, greedy(1000))
        await front.receive_rows_raw()
        await front.utility("pause_scheduler", "keep", False)  # freeze between steps
        await front.quiet(seconds=0.05)
        await front.abort("a")
        await wait_until(lambda: engine.abort_frames == 1)
        frozen = await front.quiet(seconds=0.05)
        assert all(_batch(m).outputs == [] for m in frozen)  # nothing steps (stats only)
        await front.call("resume_scheduler")
        messages: list[list[bytes]] = []
        with anyio.fail_after(5):  # up to the second late output
            while sum(o.request_id == "a" for m in messages for o in _batch(m).outputs) < 2:
                messages.append(await front.receive_raw())
        messages += await front.quiet(seconds=0.2)  # and no more after it
        assert engine.running_ids == []
    late = [o for m in messages for o in _batch(m).outputs if o.request_id == "a"]
    assert len(late) == 2 and all(o.finish_reason is None for o in late)  # never a finish
    assert all(o.new_token_ids for o in late)  # tokens


def _batch(raw: list[bytes]) -> EngineCoreOutputs:
    """The outputs message of ``raw`` (a batch of outputs or a utility reply)."""
    message = decode_outputs(raw)
    assert isinstance(message, RequestBatch | UtilityReply)
    return message.message


async def test_preemption() -> None:
    async with running_engine(faults=MockFaults(preempt_every=3)) as (_, front):
        await front.add("p", PROMPT, greedy(12))
        outs = (await front.collect("p"))["p"]
    assert [t for o in outs for t in o.new_token_ids] == greedy_tokens(PROMPT, 12)
    events = [[e.type for e in o.events] for o in outs if o.events]
    assert events[0] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert [EngineCoreEventType.PREEMPTED, EngineCoreEventType.SCHEDULED] in events[1:]
    assert outs[0].prefill_stats is not None
    assert all(o.prefill_stats is None for o in outs[1:])


async def test_abort_on_shutdown() -> None:
    faults = MockFaults(abort_on_shutdown=True)
    async with running_engine(step_time=0.01, faults=faults, max_num_seqs=1) as (engine, front):
        await front.add("k1", PROMPT, greedy(1000), trace_headers={"t": "1"})
        await front.add("k2", PROMPT, greedy(1000))
        await front.receive_rows_raw()
        await wait_until(lambda: engine.waiting_ids == ["k2"])
        front.stop_engine()
        with anyio.fail_after(5):
            while True:
                message = await front.receive()
                assert isinstance(message, RequestBatch)
                if message.message.finished_requests:
                    break
    assert message.message.finished_requests == frozenset({"k1", "k2"})
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in message.message.outputs] \
        == [("k1", [], EngineCoreFinishReason.ABORT), ("k2", [], EngineCoreFinishReason.ABORT)]
    assert message.message.outputs[0].trace_headers == {"t": "1"}
    assert message.message.scheduler_stats is None and message.message.weight_version is None


async def test_plain_shutdown_is_silent() -> None:
    """Without ``abort_on_shutdown`` a stopped engine just stops (contrast
    test_abort_on_shutdown): what was in flight has no finished output and no ABORT, and
    no step comes after."""
    async with running_engine(step_time=0.01) as (_, front):
        await front.add("k", PROMPT, greedy(1000))
        await front.receive_rows_raw()  # it runs
        front.stop_engine()
        late = await front.quiet(seconds=0.1)
        after = await front.quiet(seconds=0.2)
    for raw in late:
        message = decode_outputs(raw)
        assert isinstance(message, RequestBatch)
        assert not message.message.finished_requests
        assert all(out.finish_reason is None for out in message.message.outputs)
    assert after == []  # it stopped stepping


