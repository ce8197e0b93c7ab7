"""Generation: output shapes against golden vLLM frames, stop rules, logprobs, batching."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import anyio
import msgpack
import pytest

from anyio_genout.mock import greedy_tokens, sampled_tokens
from anyio_genout.protocol import (
    EngineCoreEventType,
    EngineCoreFinishReason,
    RequestBatch,
    decode_outputs,
)
from anyio_genout.protocol.outputs import OUTPUT_FIELDS, OUTPUTS_FIELDS
from tests.support import wait_until

from .frontend import running_engine, unpack

pytestmark = pytest.mark.anyio

WIRE = Path(__file__).resolve().parent.parent / "data" / "vllm-wire"
PROMPT = [1, 5, 6, 7, 8]
STOP = EngineCoreFinishReason.STOP
LENGTH = EngineCoreFinishReason.LENGTH


def golden(name: str) -> Any:
    return unpack((WIRE / f"{name}.frame0.bin").read_bytes())


def shape(value: Any) -> Any:
    """Type skeleton of a decoded message (maps by key set, arrays element-wise)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def greedy(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": max_tokens, **extra}


def _message(message: list[Any], name: str) -> Any:
    """A field of a raw ``EngineCoreOutputs`` array, by the protocol's name for it."""
    return message[OUTPUTS_FIELDS.index(name)]


def _output(message: list[Any], name: str) -> Any:
    """A field of a raw message's first output, by the protocol's name for it."""
    return _message(message, "outputs")[0][OUTPUT_FIELDS.index(name)]


async def test_output_shapes_match_vllm() -> None:
    first, plain, last = (golden(n) for n in ("e001_output_req-A", "e002_output_req-A",
                                               "e016_output_req-A"))
    stats_only = golden("e017_output_req-B")
    async with running_engine() as (_, front):
        await front.add("req-A", PROMPT, greedy(16))
        ours = [unpack((await front.receive_raw())[0]) for _ in range(16)]
        after = unpack((await front.receive_raw())[0])
    for mine, theirs in ((ours[0], first), (ours[1], plain), (ours[-1], last),
                         (after, stats_only)):
        assert shape(mine) == shape(theirs)
    events = _output(ours[0], "events")
    assert events[0]["type"] == 1 and events[1]["type"] == 2
    # prefill stats of a 5-token prompt
    assert _output(ours[0], "prefill_stats") == _output(first, "prefill_stats")
    assert _output(ours[-1], "finish_reason") == 1
    assert _message(ours[-1], "scheduler_stats")["num_running_reqs"] == 0
    assert [_output(m, "new_token_ids")[0] for m in ours] == greedy_tokens(PROMPT, 16)
    assert all(_message(m, "weight_version") == "default" for m in ours)


async def test_plain_step_bytes_like_disable_log_stats_golden() -> None:
    golden_hex = ("990091dc0012a57265712d4191cd02c9c0c0c0c0c0c0c0c0c0c0c000c0c0c0c0c0cb"
                  "4091461a34bdf7c8c0c0c0c0a764656661756c74")
    expected = bytes.fromhex(golden_hex)
    async with running_engine(log_stats=False) as (_, front):
        await front.add("req-A", PROMPT, greedy(3))
        frames = [await front.receive_raw() for _ in range(3)]
    assert len(frames[0][0]) > len(expected)  # prefill stats on the first output
    plain = frames[1][0]
    decoded = unpack(plain)
    ours = expected.replace(bytes.fromhex("91cd02c9"),
                            msgpack.packb([_output(decoded, "new_token_ids")[0]]))
    ours = ours.replace(bytes.fromhex("cb4091461a34bdf7c8"), b"\xcb" + struct.pack(
        ">d", _message(decoded, "timestamp")))
    assert plain == ours  # byte for byte the real engine's message, but for token and time


async def test_greedy_seeded_and_random_determinism() -> None:
    async with running_engine() as (_, front):
        await front.add("g1", PROMPT, greedy(12))
        await front.add("g2", PROMPT, greedy(12))
        await front.add("g3", [*PROMPT, 9], greedy(12))
        seeded = {"temperature": 0.8, "seed": 42, "top_k": 50, "top_p": 0.9, "max_tokens": 6}
        await front.add("s1", PROMPT, seeded)
        await front.add("s2", PROMPT, seeded)
        await front.add("u1", PROMPT, {"max_tokens": 6})
        await front.add("u2", PROMPT, {})
        got = await front.collect("g1", "g2", "g3", "s1", "s2", "u1", "u2")
    toks = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in got.items()}
    assert toks["g1"] == toks["g2"] == greedy_tokens(PROMPT, 12)
    assert toks["g3"] != toks["g1"]
    assert toks["s1"] == toks["s2"] == sampled_tokens(PROMPT, 6, seed=42)
    assert toks["u1"] != toks["u2"][:6]
    assert len(toks["u2"]) == 16  # the engine's max_tokens default


async def test_max_tokens_and_max_model_len() -> None:
    async with running_engine(max_model_len=20) as (_, front):
        await front.add("a", PROMPT, greedy(7))
        await front.add("b", list(range(1, 16)), greedy(100))
        await front.add("c", list(range(1, 31)), greedy(100))  # prompt beyond max_model_len
        got = await front.collect("a", "b", "c")
    for rid, count in (("a", 7), ("b", 5), ("c", 1)):
        outs = got[rid]
        assert len(outs) == count
        assert all(len(o.new_token_ids) == 1 for o in outs)
        assert [o.finish_reason for o in outs] == [None] * (count - 1) + [LENGTH]
        assert outs[-1].stop_reason is None


async def test_stop_token_eos_and_min_tokens() -> None:
    expected = greedy_tokens(PROMPT, 30)
    stop = next(t for i, t in enumerate(expected) if i >= 4 and t not in expected[:i])
    at = expected.index(stop)
    eos = next(t for i, t in enumerate(expected) if i >= 2 and t not in expected[:i])
    async with running_engine() as (_, front):
        await front.add("stop", PROMPT, greedy(30, stop_token_ids=[stop]))
        await front.add("eos", PROMPT, greedy(30, _eos_token_id=eos, _all_stop_token_ids=[eos]))
        await front.add("no-eos", PROMPT, greedy(30, ignore_eos=True))
        await front.add("min", PROMPT, greedy(30, stop_token_ids=[stop], min_tokens=at + 3))
        got = await front.collect("stop", "eos", "no-eos", "min")
    toks = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in got.items()}
    assert toks["stop"] == expected[:at + 1]  # the stop token is included
    assert got["stop"][-1].finish_reason == STOP and got["stop"][-1].stop_reason == stop
    assert toks["eos"] == expected[:expected.index(eos) + 1]
    assert got["eos"][-1].finish_reason == STOP and got["eos"][-1].stop_reason is None
    assert toks["no-eos"] == expected and got["no-eos"][-1].finish_reason == LENGTH
    assert stop not in toks["min"][:at + 3]  # held back by min_tokens
    assert toks["min"][:at] == expected[:at]



@pytest.mark.parametrize("speculative", [0, 3])
async def test_bad_words_token_ids_are_never_generated(speculative: int) -> None:
    expected = greedy_tokens(PROMPT, 400)
    single = expected[3]
    pair = expected[255:257]  # across the engine's first refill of the request's tokens
    assert pair[1] != single
    async with running_engine(num_speculative_tokens=speculative) as (_, front):
        await front.add("bad", PROMPT, greedy(400, _bad_words_token_ids=[[single], pair]))
        got = await front.collect("bad")
    toks = [t for o in got["bad"] for t in o.new_token_ids]
    assert len(toks) == 400 and single not in toks
    assert all(toks[i:i + 2] != pair for i in range(len(toks) - 1))
    assert toks[4:255] == expected[4:255] and toks[256] != pair[1]  # only the banned ones

async def test_min_tokens_small_vocab() -> None:
    async with running_engine(vocab_size=4) as (_, front):
        sampling = greedy(60, stop_token_ids=[0], _eos_token_id=1, _all_stop_token_ids=[1],
                          min_tokens=10)
        await front.add("m", [2, 3], sampling)
        tokens, last = await front.tokens("m")
    assert not {0, 1} & set(tokens[:10])
    assert len(tokens) > 10 and last.finish_reason == STOP
    assert tokens[-1] in (0, 1) and last.stop_reason == (0 if tokens[-1] == 0 else None)


async def test_model_eos_token() -> None:
    async with running_engine(eos_token_id=3, eos_probability=0.3) as (_, front):
        await front.add("stops", PROMPT, greedy(200, _eos_token_id=3))
        await front.add("ignores", PROMPT, greedy(200))
        got = await front.collect("stops", "ignores")
    stops = [t for o in got["stops"] for t in o.new_token_ids]
    ignores = [t for o in got["ignores"] for t in o.new_token_ids]
    assert stops[-1] == 3 and 3 not in stops[:-1] and got["stops"][-1].finish_reason == STOP
    assert len(ignores) == 200 and ignores.count(3) > 20


async def test_sample_logprobs_inline_and_aux_frames() -> None:
    async with running_engine() as (_, front):
        await front.add("lp2", PROMPT, greedy(3, logprobs=2))
        frames = await front.receive_raw()
        assert len(frames) == 1
        ids, lps, ranks, cu = _output(unpack(frames[0]), "new_logprobs")
        assert ids[:2] == ["<i4", [1, 3]] and lps[:2] == ["<f4", [1, 3]]
        assert ranks[:2] == ["<i8", [1]] and cu is None
        assert isinstance(ids[2], msgpack.ExtType) and ids[2].code == 3
        out = decode_outputs(frames)
        assert isinstance(out, RequestBatch)
        lp = out.message.outputs[0].new_logprobs
        assert lp is not None and lp.token_ids[0, 0] == out.message.outputs[0].new_token_ids[0]
        assert lp.ranks.tolist() == [1]
        await front.collect("lp2")

        await front.add("lp100", PROMPT, {"temperature": 1.0, "seed": 7, "max_tokens": 2,
                                          "logprobs": 100})
        frames = await front.receive_rows_raw()
        assert len(frames) == 3  # token ids and logprobs (404 B each) ride in aux frames
        row = _output(unpack(frames[0]), "new_logprobs")
        assert row[0] == ["<i4", [1, 101], 1] and row[1] == ["<f4", [1, 101], 2]
        out = decode_outputs(frames)
        assert isinstance(out, RequestBatch)
        lp = out.message.outputs[0].new_logprobs
        assert lp is not None and lp.token_ids.shape == (1, 101)
        assert 1 <= int(lp.ranks[0]) <= 4


async def test_prompt_logprobs_like_vllm() -> None:
    theirs = _output(golden("variant-eos-stop-logprobs/e025_output_J5"),
                     "new_prompt_logprobs_tensors")
    prompt = list(range(100, 141))  # 41 tokens, like the golden J5 request
    async with running_engine() as (_, front):
        await front.add("J5", prompt, greedy(2, prompt_logprobs=5))
        frames = await front.receive_raw()
        second = await front.receive_raw()
    assert [len(f) for f in frames] == [len(frames[0]), 960, 960]
    ours = _output(unpack(frames[0]), "new_prompt_logprobs_tensors")
    assert [a[:2] for a in ours[:3]] == [a[:2] for a in theirs[:3]]
    assert ours[0][2] == 1 and ours[1][2] == 2 and ours[3:] == [None, None]
    assert isinstance(ours[2][2], msgpack.ExtType) and len(ours[2][2].data) == 160
    out = decode_outputs(frames)
    assert isinstance(out, RequestBatch)
    plp = out.message.outputs[0].new_prompt_logprobs
    assert plp is not None and plp.token_ids[:, 0].tolist() == prompt[1:]
    # only on the first output
    assert _output(unpack(second[0]), "new_prompt_logprobs_tensors") is None


async def test_continuous_batching_beyond_max_num_seqs() -> None:
    async with running_engine(max_num_seqs=2, step_time=0.01) as (engine, front):
        await front.utility("pause_scheduler", "keep")  # hold steps until all are queued
        for i in range(5):
            await front.add(f"r{i}", [i + 1, 2, 3], greedy(4))
        assert (await front.utility("is_scheduler_paused")).result is True
        assert engine.waiting_ids == ["r0", "r1", "r2", "r3", "r4"] and engine.steps == 0
        await front.utility("resume_scheduler")
        first = await front.receive()
        assert isinstance(first, RequestBatch)
        assert len(first.message.outputs) == 2
        assert first.message.scheduler_stats is not None
        assert first.message.scheduler_stats.num_running_reqs == 2
        assert first.message.scheduler_stats.num_waiting_reqs == 3
        assert engine.waiting_ids == ["r2", "r3", "r4"]
        assert engine.running_ids == ["r0", "r1"]
        got = await front.collect("r0", "r1", "r2", "r3", "r4")
        assert engine.running_ids == engine.waiting_ids == []
    counts = {rid: sum(len(o.new_token_ids) for o in outs) for rid, outs in got.items()}
    assert counts == {"r0": 3, "r1": 3, "r2": 4, "r3": 4, "r4": 4}  # r0/r1: first seen above
    assert all(outs[0].events is not None for rid, outs in got.items() if rid >= "r2")
    queued = got["r4"][0].events
    assert queued is not None and [e.type for e in queued] == [
        EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert queued[1].timestamp - queued[0].timestamp > 0.01  # it waited for a free slot


async def test_prefix_caching_whole_blocks() -> None:
    prompt = list(range(1, 41))
    async with running_engine() as (engine, front):
        await front.add("p1", prompt, greedy(1))
        await front.collect("p1")
        await front.add("p2", prompt, greedy(1))
        await front.add("p3", prompt, greedy(1), cache_salt="other")
        await front.add("p4", prompt, greedy(1, prompt_logprobs=0))
        await front.add("p5", prompt[:33], greedy(1))
        got = await front.collect("p2", "p3", "p4", "p5")
        stats = engine.last_stats
    cached = {rid: outs[0].prefill_stats.num_cached_tokens  # type: ignore[union-attr]
              for rid, outs in got.items()}
    assert cached == {"p2": 32, "p3": 0, "p4": 0, "p5": 32}
    p2 = got["p2"][0].prefill_stats
    assert p2 is not None and p2.num_computed_tokens == 8 and p2.num_cache_creation_tokens == 0
    assert stats is not None


async def test_no_prefix_caching_and_no_log_stats() -> None:
    async with running_engine(enable_prefix_caching=False, log_stats=False) as (engine, front):
        await front.add("a", list(range(1, 41)), greedy(3))
        await front.add("b", list(range(1, 41)), greedy(3))
        got = await front.collect("a", "b")
        assert await front.quiet(seconds=0.1) == []  # no stats-only messages
    for outs in got.values():
        assert outs[0].events is None and outs[0].prefill_stats is not None
        assert outs[0].prefill_stats.num_cached_tokens == 0
    assert engine.last_stats is None


async def test_speculative_decoding() -> None:
    async with running_engine(num_speculative_tokens=3) as (engine, front):
        await front.add("s", PROMPT, greedy(50))
        outs = (await front.collect("s"))["s"]
        stats = engine.last_stats
    sizes = [len(o.new_token_ids) for o in outs]
    assert sum(sizes) == 50 and max(sizes) > 1 and all(1 <= n <= 4 for n in sizes)
    assert [t for o in outs for t in o.new_token_ids] == greedy_tokens(PROMPT, 50)
    assert stats is not None and stats.raw["spec_decoding_stats"]["num_spec_tokens"] == 3


async def test_two_clients_and_trace_headers() -> None:
    async with running_engine(n_outputs=2) as (engine, front):
        await front.add("c1", PROMPT, greedy(3), client_index=1,
                        trace_headers={"traceparent": "00-abc"})
        outs = (await front.collect("c1", client=1))["c1"]
        assert all(o.trace_headers == {"traceparent": "00-abc"} for o in outs)
        # the stats-only message after the finish goes to client 0, as vLLM sends it
        after = await front.receive(0)
        assert isinstance(after, RequestBatch) and after.message.outputs == []
        reply = await front.utility("is_sleeping", client_index=1)
        assert reply.result is False
        await front.add("bad", PROMPT, greedy(3), client_index=5)
        await front.utility("is_sleeping")
        assert any("client_index 5" in e for e in engine.errors)


async def test_request_id_reuse_after_finish_is_fine() -> None:
    async with running_engine() as (engine, front):
        for _ in range(2):
            await front.add("same", PROMPT, greedy(2))
            await front.collect("same")
        assert engine.added_ids == ["same", "same"] and not engine.dead


async def test_many_requests_one_message_per_step() -> None:
    """Each step sends one message with every running request's output: 300 requests of 5
    tokens, admitted together, arrive in 5 messages (one a step), not in 1500. The scheduler
    is paused while they are added, so how fast the adds arrive cannot spread them over
    steps (an unpaused engine on a loaded machine stepped between adds: as few as 9 outputs
    in its widest message)."""
    async with running_engine(log_stats=False, max_num_seqs=300) as (engine, front):
        assert (await front.utility("pause_scheduler", "keep", False)).result is None
        for i in range(300):
            await front.add(f"m{i}", [i % 100 + 1, 7], greedy(5))
        await front.call("resume_scheduler")
        got: dict[str, list[int]] = {f"m{i}": [] for i in range(300)}
        pending, widths = set(got), []
        with anyio.fail_after(10):
            while pending:
                message = await front.receive()
                if not isinstance(message, RequestBatch) or not message.message.outputs:
                    continue
                widths.append(len(message.message.outputs))
                for out in message.message.outputs:
                    got[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        pending.discard(out.request_id)
        steps = engine.steps
    for rid, tokens in got.items():
        i = int(rid[1:])
        assert tokens == greedy_tokens([i % 100 + 1, 7], 5)
    assert widths == [300] * 5 and steps == 5


@pytest.mark.parametrize("steps_per_checkpoint", [1, 16])
async def test_back_to_back_steps_still_read_input(steps_per_checkpoint: int) -> None:
    """With no step time and several steps per yield, an abort sent while a request runs
    still ends it (within that many steps), and the outputs are those of any pacing."""
    async with running_engine(log_stats=False, steps_per_checkpoint=steps_per_checkpoint,
                              max_model_len=100_000) as (engine, front):
        await front.add("long", PROMPT, greedy(50_000))
        await front.add("short", [3, 4], greedy(40))
        got = await front.collect("short")
        assert [t for o in got["short"] for t in o.new_token_ids] == greedy_tokens([3, 4], 40)
        await front.abort("long")
        await wait_until(lambda: "long" not in engine.running_ids)
        assert engine.steps < 50_000
