"""Unit tests without I/O: inflight tracking, request preparation, finish reasons, matcher."""

from __future__ import annotations

import bisect
import itertools
import re

import pytest

from anyio_genout import (
    FinishReason,
    FinishReasonKind,
    GenerateRequest,
    InvalidRequestError,
    LoRARequest,
    SamplingParams,
)
from anyio_genout.generate import InflightRequests
from anyio_genout.generate.request import internal_request_id
from anyio_genout.generate.stop_sequences import StopSequenceMatcher
from anyio_genout.protocol import EngineCoreFinishReason

# ---------------------------------------------------------------------- inflight


def test_resolves_external_to_internal() -> None:
    inflight = InflightRequests()
    assert inflight.resolve(["unknown"]) == []
    assert inflight.resolve([]) == []
    guard = inflight.track("req-a", "req-a-1")
    assert inflight.resolve(["req-a"]) == ["req-a-1"]
    assert inflight.resolve(["unknown", "req-a"]) == ["req-a-1"]
    assert inflight.all_internal_ids() == ["req-a-1"]
    guard.release()
    assert inflight.resolve(["req-a"]) == []


def test_one_external_maps_to_many_internal() -> None:
    inflight = InflightRequests()
    guards = [inflight.track("req-a", f"req-a-{i}") for i in range(3)]
    other = inflight.track("req-b", "req-b-0")
    assert sorted(inflight.resolve(["req-a"])) == ["req-a-0", "req-a-1", "req-a-2"]
    assert sorted(inflight.resolve(["req-a", "req-b"])) == [
        "req-a-0", "req-a-1", "req-a-2", "req-b-0"]
    assert sorted(inflight.all_internal_ids()) == ["req-a-0", "req-a-1", "req-a-2", "req-b-0"]
    assert len(inflight) == 2
    for guard in (*guards, other):
        guard.release()
    assert len(inflight) == 0


def test_dropping_guard_removes_only_its_own_edge_then_cleans_empty_key() -> None:
    inflight = InflightRequests()
    first = inflight.track("req-a", "req-a-1")
    second = inflight.track("req-a", "req-a-2")
    first.release()
    assert inflight.resolve(["req-a"]) == ["req-a-2"]
    assert len(inflight) == 1
    first.release()  # idempotent: does not touch the other edge
    assert inflight.resolve(["req-a"]) == ["req-a-2"]
    second.release()
    assert inflight.resolve(["req-a"]) == []
    assert len(inflight) == 0  # the empty external key is gone
    assert inflight._edges == {}


def test_identical_edges_are_refcounted_across_guards() -> None:
    inflight = InflightRequests()
    first = inflight.track("req-a", "req-a")
    second = inflight.track("req-a", "req-a")
    assert inflight.resolve(["req-a"]) == ["req-a"]  # one id, not two
    first.release()
    assert inflight.resolve(["req-a"]) == ["req-a"]  # the other guard keeps it
    second.release()
    assert inflight.resolve(["req-a"]) == []


def test_releasing_a_guard_frees_its_entry_and_only_once() -> None:
    """The guard holds its map, so the entry lives until release, which frees it (once)."""
    inflight = InflightRequests()
    guard = inflight.track("req-a", "req-a-1")
    other = inflight.track("req-b", "req-b-1")
    assert len(inflight) == 2
    assert inflight.resolve(["req-a"]) == ["req-a-1"]
    guard.release()
    assert len(inflight) == 1
    assert inflight.resolve(["req-a"]) == []
    assert inflight.all_internal_ids() == ["req-b-1"]
    guard.release()  # a second release touches nothing, not even another guard's entry
    again = inflight.track("req-a", "req-a-1")  # the same pair, tracked anew
    guard.release()
    assert len(inflight) == 2
    assert sorted(inflight.resolve(["req-a", "req-b"])) == ["req-a-1", "req-b-1"]
    again.release()
    other.release()
    assert len(inflight) == 0
    assert inflight.resolve(["req-a", "req-b"]) == []


# ---------------------------------------------------------------------- request preparation


def _request(**kw: object) -> GenerateRequest:
    fields: dict[str, object] = {"request_id": "req-1", "prompt_token_ids": [11, 22]}
    fields.update(kw)
    return GenerateRequest(**fields)  # type: ignore[arg-type]


def test_prepare_builds_engine_core_request() -> None:
    lora = LoRARequest("adapter", 3, "/tmp/adapter")
    req = _request(
        sampling_params=SamplingParams(max_tokens=4), arrival_time=42.5, cache_salt="salt",
        data_parallel_rank=1, trace_headers={"traceparent": "00-abc"}, priority=-2,
        lora_request=lora)
    internal = internal_request_id(req.request_id, True)
    assert re.fullmatch(r"req-1-[0-9a-f]{8}", internal)
    assert internal != "req-1"
    assert internal_request_id("req-1", True) != internal  # random suffix each time
    engine = req.to_engine_request(internal)
    assert engine.request_id == internal
    assert engine.external_req_id == "req-1"
    assert engine.prompt_token_ids == (11, 22)
    assert engine.arrival_time == 42.5
    assert engine.cache_salt == "salt"
    assert engine.data_parallel_rank == 1
    assert engine.trace_headers == {"traceparent": "00-abc"}
    assert engine.priority == -2
    assert engine.lora_request == lora
    assert engine.sampling_params == SamplingParams(max_tokens=4)
    assert engine.client_index == 0 and engine.current_wave == 0


def test_prepare_defaults_arrival_time_to_wall_clock_now() -> None:
    import time

    before = time.time()
    engine = _request().to_engine_request("req-1-x")
    assert before <= engine.arrival_time <= time.time()


def test_prepare_can_preserve_external_request_id() -> None:
    assert internal_request_id("req-1", False) == "req-1"
    engine = _request().to_engine_request(internal_request_id("req-1", False))
    assert engine.request_id == engine.external_req_id == "req-1"


def test_prepare_rejects_empty_prompt_tokens() -> None:
    # to_engine_request only builds; the one validation (validate) refuses.
    with pytest.raises(InvalidRequestError) as info:
        _request(prompt_token_ids=[]).to_engine_request("req-1-x").validate()
    assert info.value.field == "prompt_token_ids"
    assert "must not be empty" in str(info.value)


@pytest.mark.parametrize("bad", [{"request_id": ""}, {"request_id": 7},
                                 {"sampling_params": {"max_tokens": 3}}])
def test_prepare_rejects_invalid_fields(bad: dict[str, object]) -> None:
    request = _request(**bad)
    with pytest.raises(InvalidRequestError) as info:
        request.to_engine_request(internal_request_id(request.request_id, True)).validate()
    assert info.value.field == next(iter(bad))


def test_prepare_fills_eos_token_id_unless_set() -> None:
    def eos(params: SamplingParams) -> int | None:
        return _request(sampling_params=params).to_engine_request(
            "x", eos_token_id=2).sampling_params.eos_token_id

    assert eos(SamplingParams()) == 2
    assert eos(SamplingParams(eos_token_id=9)) == 9  # the request's own wins
    # Filled even when ignored, as vLLM does: min_tokens still holds EOS back.
    assert eos(SamplingParams(ignore_eos=True)) == 2
    assert "_eos_token_id" not in SamplingParams(ignore_eos=True, eos_token_id=2).to_wire()
    assert SamplingParams(ignore_eos=True, eos_token_id=2).to_wire()["_all_stop_token_ids"] == [2]
    assert _request().to_engine_request("x").sampling_params.eos_token_id is None


# ---------------------------------------------------------------------- finish reasons


def test_finish_reason_mapping_and_labels() -> None:
    assert FinishReason.stop_eos() == FinishReason.stop() == FinishReason.STOP
    assert FinishReason.stop_eos().stop_reason is None
    cases = {
        (EngineCoreFinishReason.STOP, None): (FinishReason.stop_eos(), "stop"),
        (EngineCoreFinishReason.STOP, 7): (FinishReason.stop(7), "stop"),
        (EngineCoreFinishReason.STOP, "</s>"): (FinishReason.stop("</s>"), "stop"),
        (EngineCoreFinishReason.LENGTH, None): (FinishReason.LENGTH, "length"),
        (EngineCoreFinishReason.ABORT, None): (FinishReason.ABORT, "abort"),
        (EngineCoreFinishReason.ERROR, None): (FinishReason.ERROR, "error"),
        (EngineCoreFinishReason.REPETITION, 5): (FinishReason.repetition(5), "repetition"),
        (EngineCoreFinishReason.REPETITION, None): (FinishReason.REPETITION, "repetition"),
    }
    for (raw, stop_reason), (expected, label) in cases.items():
        reason = FinishReason.from_engine(raw, stop_reason)
        assert reason == expected
        assert reason.as_str() == label == reason.kind.value
    assert FinishReason.stop((5, 6)).stop_reason == (5, 6)
    assert FinishReason.stop((5, 6)).kind is FinishReasonKind.STOP
    assert FinishReason.from_engine(EngineCoreFinishReason.LENGTH, 3).stop_reason is None
    assert str(FinishReason.stop(7)) == "stop(7)" and str(FinishReason.LENGTH) == "length"


# ---------------------------------------------------------------------- stop sequences


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ([[5, 6, 7]], (2, (5, 6))),                  # within one step, later token dropped
        ([[1, 5], [6]], (1, (5, 6))),                # straddles a step boundary
        ([[1, 2], [4, 1], [2, 3]], (2, (1, 2, 3))),  # false start, then a full match
        ([[5], [], [6]], (1, (5, 6))),               # empty step in between
        ([[4, 5], [4, 6]], None),                    # interrupted: no match
        ([[9, 9, 9, 9]], None),
    ],
)
def test_stop_sequence_matcher(steps: list[list[int]],
                               expected: tuple[int, tuple[int, ...]] | None) -> None:
    matcher = StopSequenceMatcher([(5, 6), (1, 2, 3)])
    result = None
    for step in steps:
        result = matcher.feed(step)
        if result is not None:
            break
    assert result == expected


def _vllm_check_stop_strings(output_text: str, new_char_count: int,
                             stop: list[str]) -> tuple[str, int] | None:
    """vLLM 0.32's ``check_stop_strings`` (vllm/v1/engine/detokenizer.py), without
    ``include_stop_str_in_output``."""
    if not new_char_count or not stop:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for stop_str in stop:
        index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if index != -1 and (best is None or index + len(stop_str) < best[0]):
            best = (index + len(stop_str), index, stop_str)
    return None if best is None else (best[2], best[1])


def _vllm_stop(steps: list[list[int]], sequences: list[tuple[int, ...]],
               min_tokens: int) -> tuple[int, tuple[int, ...] | None]:
    """Tokens kept and the sequence matched, as vLLM's detokenizer would with stop strings
    (``update``: min_tokens offset, earliest match, tokens after it dropped), each token
    id spelled as one character so that token and text boundaries coincide."""
    spell = {s: "".join(chr(65 + t) for t in s) for s in sequences}
    text, count = "", 0
    for step in steps:
        previous = count
        offsets = [len(text)]
        for token in step:
            text += chr(65 + token)
            count += 1
            offsets.append(len(text))
        if count > min_tokens:
            check_from = offsets[max(min_tokens - previous, 0)]
            stop = _vllm_check_stop_strings(text, len(text) - check_from,
                                            [spell[s] for s in sequences])
            if stop is not None:
                stop_str, start = stop
                kept = bisect.bisect_left(offsets, start + len(stop_str), lo=1)
                matched = next(s for s in sequences if spell[s] == stop_str)
                return previous + kept, matched
    return count, None


@pytest.mark.parametrize("sequences", [[(5, 6)], [(6,), (5, 6)], [(5, 6, 5), (6, 5)]])
@pytest.mark.parametrize("min_tokens", [0, 1, 2, 3, 5])
def test_stop_sequences_and_min_tokens_agree_with_vllms_stop_strings(
        sequences: list[tuple[int, ...]], min_tokens: int) -> None:
    """Every 6-token output over {5, 6, 7}, in one step, token by token, and in pairs."""
    for tokens in itertools.product((5, 6, 7), repeat=6):
        for size in (6, 1, 2):
            steps = [list(tokens[i:i + size]) for i in range(0, len(tokens), size)]
            matcher = StopSequenceMatcher(sequences, min_tokens)
            got: tuple[int, tuple[int, ...] | None] = (len(tokens), None)
            done = 0
            for step in steps:
                result = matcher.feed(step)
                if result is not None:
                    got = (done + result[0], result[1])
                    break
                done += len(step)
            assert got == _vllm_stop(steps, sequences, min_tokens), (tokens, size)
