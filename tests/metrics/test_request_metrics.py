"""Per-request and scheduler metrics: tracker state, exposition lines, registries, buckets."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import prometheus_client
import pytest

from anyio_genout.metrics import (
    FINISHED_REASONS,
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    EngineTotals,
    Metrics,
    build_1_2_5_buckets,
    build_buckets,
    finish_reason_label,
)
from anyio_genout.protocol.outputs import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreFinishReason,
    EngineCoreOutput,
    PrefillStats,
    SchedulerStats,
)

QUEUED = EngineCoreEventType.QUEUED
SCHEDULED = EngineCoreEventType.SCHEDULED
PREEMPTED = EngineCoreEventType.PREEMPTED

_SAMPLE = re.compile(r"^(?P<name>[^{\s]+)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def output(
    tokens: Sequence[int],
    *events: tuple[EngineCoreEventType, float],
    prefill: PrefillStats | None = None,
    finish: EngineCoreFinishReason | None = None,
) -> EngineCoreOutput:
    return EngineCoreOutput(
        "req-1",
        list(tokens),
        finish_reason=finish,
        events=[EngineCoreEvent(kind, ts) for kind, ts in events] or None,
        prefill_stats=prefill,
    )


def exposition(metrics: Metrics) -> list[str]:
    """``generate_latest`` sample lines with labels in vLLM's order (model_name, engine, rest).

    prometheus-client 0.22+ sorts label names alphabetically when rendering (the order is not
    significant in the text format); normalising lets the tests compare vLLM's lines exactly.
    """
    lines = []
    for line in prometheus_client.generate_latest(metrics.registry).decode().splitlines():
        match = _SAMPLE.match(line)
        if line.startswith("#") or match is None:
            lines.append(line)
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        order = [k for k in ("model_name", "engine") if k in labels]
        order += [k for k in labels if k not in order]
        rendered = ",".join(f'{k}="{labels[k]}"' for k in order)
        lines.append(f"{match['name']}{{{rendered}}} {match['value']}" if labels
                     else f"{match['name']} {match['value']}")
    return lines


def value(metrics: Metrics, name: str, engine: int, **extra: str) -> float | None:
    labels = {"model_name": metrics.model_name, "engine": str(engine), **extra}
    result = metrics.registry.get_sample_value(name, labels)
    return None if result is None else float(result)


# ---------------------------------------------------------------- tracker state (§2.3)


def test_tracker_updates_timing_state_across_prefill_decode_and_finish() -> None:
    metrics = Metrics(model_name="m")
    tracker = metrics.tracker(engine_index=2, arrival_time=100.0, prompt_len=64, max_tokens=128)
    tracker.observe_output(
        10.0, 100.2,
        output([1], (QUEUED, 8.0), (SCHEDULED, 9.0),
               prefill=PrefillStats(num_prompt_tokens=64, num_computed_tokens=60,
                                    num_cached_tokens=4)),
    )
    tracker.observe_output(11.5, 101.7, output([2, 3], (PREEMPTED, 10.5)))

    assert tracker.is_prefilling is False
    assert tracker.engine_index == 2
    assert tracker.num_generation_tokens == 3
    assert tracker.queued_ts == 8.0
    assert tracker.scheduled_ts == 9.0
    assert tracker.first_token_ts == 10.0
    assert tracker.last_token_ts == 11.5
    assert tracker.first_token_latency == pytest.approx(0.2)
    assert tracker.last_token_ts - tracker.first_token_ts == pytest.approx(1.5)
    assert tracker.num_preemptions == 1
    assert tracker.latest_num_cached_tokens == 4
    # One ITL sample of 1.5 s (engine clock) and one TTFT sample of 0.2 s (wall clock).
    assert value(metrics, "vllm:inter_token_latency_seconds_count", 2) == 1
    assert value(metrics, "vllm:inter_token_latency_seconds_sum", 2) == pytest.approx(1.5)
    assert value(metrics, "vllm:time_to_first_token_seconds_count", 2) == 1
    assert value(metrics, "vllm:time_to_first_token_seconds_sum", 2) == pytest.approx(0.2)

    tracker.record_finished(101.8, "length")
    assert tracker.finished
    expected_sums = {
        "vllm:e2e_request_latency_seconds": 1.8,
        "vllm:request_queue_time_seconds": 1.0,  # 9 - 8
        "vllm:request_prefill_time_seconds": 1.0,  # 10 - 9
        "vllm:request_decode_time_seconds": 1.5,  # 11.5 - 10
        "vllm:request_inference_time_seconds": 2.5,  # 11.5 - 9
        "vllm:request_time_per_output_token_seconds": 0.75,  # 1.5 / (3 - 1)
        "vllm:request_prompt_tokens": 64,
        "vllm:request_generation_tokens": 3,
        "vllm:request_max_num_generation_tokens": 3,
        "vllm:request_params_max_tokens": 128,
        "vllm:request_params_n": 1,
        "vllm:request_prefill_kv_computed_tokens": 60,  # 64 - 4 cached
        "vllm:request_num_preemptions": 1,
    }
    for name, expected in expected_sums.items():
        assert value(metrics, name + "_count", 2) == 1, name
        assert value(metrics, name + "_sum", 2) == pytest.approx(expected), name
    assert value(metrics, "vllm:request_success_total", 2, finished_reason="length") == 1
    assert value(metrics, "vllm:prompt_tokens_total", 2) == 64
    assert value(metrics, "vllm:prompt_tokens_cached_total", 2) == 4
    assert value(metrics, "vllm:prompt_tokens_by_source_total", 2, source="local_compute") == 60
    assert value(metrics, "vllm:generation_tokens_total", 2) == 3
    assert value(metrics, "vllm:num_preemptions_total", 2) == 1


def test_each_finished_request_value_lands_in_its_own_histogram() -> None:
    """Thirteen values are queued per finished request and folded in by column: every value
    here is distinct (but the two that are the same by definition), so a value filed under
    another histogram's column shows."""
    metrics = Metrics(model_name="m")
    tracker = metrics.tracker(engine_index=0, arrival_time=100.0, prompt_len=64, max_tokens=128)
    tracker.observe_output(4.0, 100.5, output([1], (QUEUED, 2.25), (SCHEDULED, 2.5),
                                              prefill=PrefillStats(64, 60, 4)))
    tracker.observe_output(5.0, 101.0, output([2, 3, 4], (PREEMPTED, 4.5)))
    tracker.observe_output(7.5, 101.5, output([5, 6, 7, 8], (PREEMPTED, 6.0)))
    tracker.record_finished(109.75, "stop")
    expected_sums = {
        "vllm:e2e_request_latency_seconds": 9.75,
        "vllm:request_queue_time_seconds": 0.25,
        "vllm:request_prefill_time_seconds": 1.5,
        "vllm:request_decode_time_seconds": 3.5,
        "vllm:request_inference_time_seconds": 5.0,
        "vllm:request_time_per_output_token_seconds": 0.5,  # 3.5 / (8 - 1)
        "vllm:request_prompt_tokens": 64,
        "vllm:request_generation_tokens": 8,
        "vllm:request_max_num_generation_tokens": 8,  # = generation tokens, as in vLLM
        "vllm:request_params_max_tokens": 128,
        "vllm:request_params_n": 1,
        "vllm:request_prefill_kv_computed_tokens": 60,
        "vllm:request_num_preemptions": 2,
    }
    got = {name: value(metrics, name + "_sum", 0) for name in expected_sums}
    assert got == expected_sums


def test_initial_tracker_state() -> None:
    tracker = Metrics().tracker(engine_index=7, arrival_time=3.0, prompt_len=5, max_tokens=None)
    assert (tracker.engine_index, tracker.arrival_time, tracker.prompt_len,
            tracker.max_tokens) == (7, 3.0, 5, None)
    assert tracker.is_prefilling
    assert not tracker.finished
    assert (tracker.num_generation_tokens, tracker.num_preemptions,
            tracker.latest_num_cached_tokens) == (0, 0, 0)
    assert (tracker.queued_ts, tracker.scheduled_ts, tracker.first_token_ts,
            tracker.last_token_ts, tracker.first_token_latency) == (0.0, 0.0, 0.0, 0.0, 0.0)


def test_queued_last_wins_and_scheduled_first_wins() -> None:
    metrics = Metrics()
    tracker = metrics.tracker(engine_index=0, arrival_time=1.0, prompt_len=4, max_tokens=8)
    tracker.observe_output(5.0, 1.1, output([], (QUEUED, 2.0), (SCHEDULED, 3.0)))
    tracker.observe_output(6.0, 1.2, output([], (PREEMPTED, 3.5), (QUEUED, 4.0),
                                            (SCHEDULED, 4.5)))
    assert tracker.queued_ts == 4.0
    assert tracker.scheduled_ts == 3.0
    assert tracker.num_preemptions == 1


def test_outputs_without_tokens_record_no_ttft_or_itl() -> None:
    metrics = Metrics()
    tracker = metrics.tracker(engine_index=0, arrival_time=1.0, prompt_len=4, max_tokens=8)
    tracker.observe_output(5.0, 1.1, output([], prefill=PrefillStats(4, 4)))
    assert tracker.is_prefilling
    assert tracker.first_token_ts == 0.0
    assert value(metrics, "vllm:time_to_first_token_seconds_count", 0) == 0
    tracker.observe_output(6.0, 1.2, output([7]))
    tracker.observe_output(7.0, 1.3, output([], finish=EngineCoreFinishReason.STOP))
    assert tracker.last_token_ts == 6.0
    assert tracker.num_generation_tokens == 1
    assert value(metrics, "vllm:time_to_first_token_seconds_count", 0) == 1
    assert value(metrics, "vllm:inter_token_latency_seconds_count", 0) == 0


def test_prompt_counters_need_prefill_stats_on_the_first_token_output() -> None:
    metrics = Metrics()
    tracker = metrics.tracker(engine_index=0, arrival_time=1.0, prompt_len=4, max_tokens=8)
    tracker.observe_output(5.0, 1.1, output([1]))
    tracker.observe_output(6.0, 1.2, output([2], prefill=PrefillStats(4, 1, 3, 3)))
    assert tracker.latest_num_cached_tokens == 3
    assert value(metrics, "vllm:prompt_tokens_total", 0) == 0
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert value(metrics, "vllm:prompt_tokens_by_source_total", 0, source=source) == 0
    tracker.record_finished(2.0, "stop")
    assert value(metrics, "vllm:request_prefill_kv_computed_tokens_sum", 0) == 1


def test_itl_is_one_sample_per_output_on_the_engine_clock() -> None:
    metrics = Metrics()
    tracker = metrics.tracker(engine_index=0, arrival_time=1000.0, prompt_len=4, max_tokens=None)
    for ts in (50.0, 50.25, 50.75, 51.0):
        tracker.observe_output(ts, 9999.0, output([1, 2, 3]))
    assert value(metrics, "vllm:inter_token_latency_seconds_count", 0) == 3
    assert value(metrics, "vllm:inter_token_latency_seconds_sum", 0) == pytest.approx(1.0)
    assert value(metrics, "vllm:generation_tokens_total", 0) == 12


def test_phase_times_are_zero_when_timestamps_are_missing_or_out_of_order() -> None:
    metrics = Metrics()
    tracker = metrics.tracker(engine_index=0, arrival_time=10.0, prompt_len=4, max_tokens=None)
    # SCHEDULED after the first token (clock skew) and no QUEUED event; one token only.
    tracker.observe_output(5.0, 10.5, output([1], (SCHEDULED, 6.0)))
    tracker.record_finished(9.0, "abort")  # e2e negative: recorded as is, no guard
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time",
                 "time_per_output_token"):
        assert value(metrics, f"vllm:request_{name}_seconds_count", 0) == 1, name
        assert value(metrics, f"vllm:request_{name}_seconds_sum", 0) == 0, name
    assert value(metrics, "vllm:e2e_request_latency_seconds_sum", 0) == pytest.approx(-1.0)
    assert value(metrics, "vllm:request_params_max_tokens_count", 0) == 0


# ---------------------------------------------------------------- record_finished


def test_record_finished_is_idempotent() -> None:
    metrics = Metrics()
    tracker = metrics.tracker(engine_index=1, arrival_time=1.0, prompt_len=4, max_tokens=8)
    tracker.observe_output(5.0, 1.5, output([1]))
    tracker.record_finished(2.0, "stop")
    before = exposition(metrics)
    tracker.record_finished(3.0, "abort")
    tracker.record_finished(4.0, "stop")
    assert tracker.finished
    assert exposition(metrics) == before
    assert value(metrics, "vllm:request_success_total", 1, finished_reason="stop") == 1
    assert value(metrics, "vllm:request_success_total", 1, finished_reason="abort") == 0
    assert value(metrics, "vllm:e2e_request_latency_seconds_count", 1) == 1


def test_no_finish_metric_is_recorded_before_finish() -> None:
    metrics = Metrics(model_name="m")
    tracker = metrics.tracker(engine_index=0, arrival_time=1.0, prompt_len=2, max_tokens=8)
    tracker.observe_output(10.0, 1.1, output([1], (QUEUED, 8.0), (SCHEDULED, 9.0),
                                             prefill=PrefillStats(2, 2)))
    tracker.observe_output(11.0, 1.2, output([2]))
    for reason in FINISHED_REASONS:
        assert value(metrics, "vllm:request_success_total", 0, finished_reason=reason) == 0
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds",
                 "request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens", "request_params_max_tokens",
                 "request_params_n", "request_num_preemptions",
                 "request_prefill_kv_computed_tokens"):
        assert value(metrics, f"vllm:{name}_count", 0) == 0, name
    # The per-output ones are live.
    assert value(metrics, "vllm:generation_tokens_total", 0) == 2
    assert value(metrics, "vllm:time_to_first_token_seconds_count", 0) == 1
    assert value(metrics, "vllm:inter_token_latency_seconds_count", 0) == 1


def test_finish_reason_labels() -> None:
    assert [finish_reason_label(r) for r in EngineCoreFinishReason] == [
        "stop", "length", "abort", "error", "repetition"]
    metrics = Metrics()
    tracker = metrics.tracker(engine_index=0, arrival_time=1.0, prompt_len=1, max_tokens=None)
    tracker.record_finished(2.0, EngineCoreFinishReason.REPETITION)
    assert value(metrics, "vllm:request_success_total", 0, finished_reason="repetition") == 1
    other = metrics.tracker(engine_index=0, arrival_time=1.0, prompt_len=1, max_tokens=None)
    other.record_finished(2.0, "cancelled")  # unknown labels get their own series
    assert value(metrics, "vllm:request_success_total", 0, finished_reason="cancelled") == 1


# ---------------------------------------------------------------- exposition (§2.1 tests 9, 10)


def test_exposition_of_a_generate_request() -> None:
    metrics = Metrics(model_name="m-gen")
    tracker = metrics.tracker(engine_index=4, arrival_time=1700000000.0, prompt_len=2,
                              max_tokens=3)
    tracker.observe_output(10.0, 1700000000.25,
                           output([1], (QUEUED, 8.0), (SCHEDULED, 9.0),
                                  prefill=PrefillStats(num_prompt_tokens=2,
                                                       num_computed_tokens=2)))
    tracker.observe_output(11.5, 1700000001.75,
                           output([2, 3], (PREEMPTED, 10.5),
                                  finish=EngineCoreFinishReason.LENGTH))
    tracker.record_finished(1700000001.75, "length")

    lines = exposition(metrics)
    labels = 'model_name="m-gen",engine="4"'
    for expected in [
        f'vllm:request_success_total{{{labels},finished_reason="length"}} 1.0',
        f'vllm:request_success_total{{{labels},finished_reason="stop"}} 0.0',
        f"vllm:prompt_tokens_total{{{labels}}} 2.0",
        f'vllm:prompt_tokens_by_source_total{{{labels},source="local_compute"}} 2.0',
        f'vllm:prompt_tokens_by_source_total{{{labels},source="local_cache_hit"}} 0.0',
        f'vllm:prompt_tokens_by_source_total{{{labels},source="external_kv_transfer"}} 0.0',
        f"vllm:prompt_tokens_cached_total{{{labels}}} 0.0",
        f"vllm:generation_tokens_total{{{labels}}} 3.0",
        f"vllm:num_preemptions_total{{{labels}}} 1.0",
        f"vllm:request_num_preemptions_sum{{{labels}}} 1.0",
        f"vllm:request_num_preemptions_count{{{labels}}} 1.0",
        f'vllm:request_num_preemptions_bucket{{{labels},le="1.0"}} 1.0',
        f"vllm:time_to_first_token_seconds_count{{{labels}}} 1.0",
        f"vllm:time_to_first_token_seconds_sum{{{labels}}} 0.25",
        f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} 0.0',
        f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.25"}} 1.0',
        f"vllm:inter_token_latency_seconds_count{{{labels}}} 1.0",
        f"vllm:inter_token_latency_seconds_sum{{{labels}}} 1.5",
        f"vllm:e2e_request_latency_seconds_count{{{labels}}} 1.0",
        f"vllm:e2e_request_latency_seconds_sum{{{labels}}} 1.75",
        f"vllm:request_prompt_tokens_count{{{labels}}} 1.0",
        f"vllm:request_prompt_tokens_sum{{{labels}}} 2.0",
        f"vllm:request_generation_tokens_count{{{labels}}} 1.0",
        f"vllm:request_generation_tokens_sum{{{labels}}} 3.0",
        f"vllm:request_prefill_kv_computed_tokens_count{{{labels}}} 1.0",
        f"vllm:request_params_max_tokens_sum{{{labels}}} 3.0",
        f'vllm:request_params_n_bucket{{{labels},le="1.0"}} 1.0',
        f"vllm:request_queue_time_seconds_sum{{{labels}}} 1.0",
        f"vllm:request_decode_time_seconds_sum{{{labels}}} 1.5",
        "# TYPE vllm:request_success_total counter",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        "# TYPE vllm:num_requests_running gauge",
    ]:
        assert expected in lines, expected
    assert not [line for line in lines if "_created" in line]


def test_exposition_of_an_aborted_request() -> None:
    metrics = Metrics(model_name="m-abort")
    tracker = metrics.tracker(engine_index=5, arrival_time=50.0, prompt_len=2, max_tokens=16)
    tracker.observe_output(10.0, 50.1, output([99], (QUEUED, 8.0), (SCHEDULED, 9.0)))
    tracker.record_finished(50.5, "abort")
    lines = exposition(metrics)
    labels = 'model_name="m-abort",engine="5"'
    for expected in [
        f'vllm:request_success_total{{{labels},finished_reason="abort"}} 1.0',
        f'vllm:request_success_total{{{labels},finished_reason="length"}} 0.0',
        f"vllm:e2e_request_latency_seconds_count{{{labels}}} 1.0",
        f"vllm:request_num_preemptions_sum{{{labels}}} 0.0",
        f"vllm:request_num_preemptions_count{{{labels}}} 1.0",
    ]:
        assert expected in lines, expected


def test_label_names_follow_vllm_order() -> None:
    metrics = Metrics()
    metrics.tracker(engine_index=0, arrival_time=0.0, prompt_len=1, max_tokens=None)
    families = {m.name: m for m in metrics.registry.collect()}
    expected = {
        "vllm:request_success": ["model_name", "engine", "finished_reason"],
        "vllm:prompt_tokens_by_source": ["model_name", "engine", "source"],
        "vllm:num_requests_waiting_by_reason": ["model_name", "engine", "reason"],
        "vllm:generation_tokens": ["model_name", "engine"],
        "vllm:kv_cache_usage_perc": ["model_name", "engine"],
    }
    for name, label_names in expected.items():
        sample = families[name].samples[0]
        assert list(sample.labels) == label_names, name


def test_every_vllm_metric_is_exposed_once_an_engine_is_seen() -> None:
    metrics = Metrics()
    before = metrics.engine_indexes
    metrics.observe_scheduler_stats(0, SchedulerStats())
    assert (before, metrics.engine_indexes) == ((), (0,))
    families = {m.name: m.type for m in metrics.registry.collect() if m.samples}
    counters = ["request_success", "prompt_tokens", "prompt_tokens_by_source",
                "prompt_tokens_cached", "generation_tokens", "num_preemptions",
                "prefix_cache_queries", "prefix_cache_hits"]
    histograms = ["time_to_first_token_seconds", "inter_token_latency_seconds",
                  "e2e_request_latency_seconds", "request_queue_time_seconds",
                  "request_inference_time_seconds", "request_prefill_time_seconds",
                  "request_decode_time_seconds", "request_time_per_output_token_seconds",
                  "request_prompt_tokens", "request_generation_tokens",
                  "request_max_num_generation_tokens", "request_params_max_tokens",
                  "request_params_n", "request_num_preemptions",
                  "request_prefill_kv_computed_tokens"]
    gauges = ["num_requests_running", "num_requests_waiting", "num_requests_waiting_by_reason",
              "kv_cache_usage_perc"]
    # vLLM 0.32's per-step families beyond those (metrics/steps.py); all but
    # vllm:cache_config_info, which the engines do not send (docs/metrics.md).
    counters += ["external_prefix_cache_queries", "external_prefix_cache_hits",
                 "mm_cache_queries", "mm_cache_hits", "prompt_tokens_cached_by_source",
                 "admission_rejections", "estimated_flops_per_gpu",
                 "estimated_read_bytes_per_gpu", "estimated_write_bytes_per_gpu"]
    histograms += ["iteration_tokens_total"]
    gauges += ["engine_sleep_state"]
    assert families == {
        **{f"vllm:{n}": "counter" for n in counters},
        **{f"vllm:{n}": "histogram" for n in histograms},
        **{f"vllm:{n}": "gauge" for n in gauges},
    }
    assert len(families) == 38  # the 27, and 11 of vLLM 0.32's 12 more


# ---------------------------------------------------------------- scheduler stats (§3.14)


def test_scheduler_stats_set_gauges_and_add_prefix_cache_increments() -> None:
    metrics = Metrics(model_name="m")
    metrics.observe_scheduler_stats(3, SchedulerStats(
        num_running_reqs=7, num_waiting_reqs=4, num_skipped_waiting_reqs=2,
        kv_cache_usage=0.25, prefix_cache_queries=100, prefix_cache_hits=40))
    metrics.observe_scheduler_stats(3, SchedulerStats(
        num_running_reqs=5, num_waiting_reqs=1, num_skipped_waiting_reqs=0,
        kv_cache_usage=0.5, prefix_cache_queries=20, prefix_cache_hits=10))
    lines = exposition(metrics)
    labels = 'model_name="m",engine="3"'
    for expected in [
        f"vllm:num_requests_running{{{labels}}} 5.0",
        f"vllm:num_requests_waiting{{{labels}}} 1.0",
        f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} 1.0',
        f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} 0.0',
        f"vllm:kv_cache_usage_perc{{{labels}}} 0.5",
        f"vllm:prefix_cache_queries_total{{{labels}}} 120.0",
        f"vllm:prefix_cache_hits_total{{{labels}}} 50.0",
    ]:
        assert expected in lines, expected
    metrics.observe_scheduler_stats(3, SchedulerStats(num_waiting_reqs=3,
                                                      num_skipped_waiting_reqs=2))
    assert value(metrics, "vllm:num_requests_waiting", 3) == 5
    assert value(metrics, "vllm:num_requests_waiting_by_reason", 3, reason="deferred") == 2
    assert metrics.snapshot() == {3: EngineTotals(
        3, prefix_cache_queries=120, prefix_cache_hits=50, num_running=0, num_waiting=5,
        kv_cache_usage=0.0, has_scheduler_stats=True)}


def test_engines_have_separate_series_and_totals() -> None:
    metrics = Metrics()
    a = metrics.tracker(engine_index=0, arrival_time=1.0, prompt_len=8, max_tokens=None)
    b = metrics.tracker(engine_index=1, arrival_time=1.0, prompt_len=8, max_tokens=None)
    a.observe_output(2.0, 1.5, output([1, 2], prefill=PrefillStats(8, 6, 2, 2)))
    b.observe_output(2.0, 1.5, output([1], prefill=PrefillStats(8, 8)))
    b.observe_output(3.0, 1.6, output([2, 3, 4]))
    assert value(metrics, "vllm:generation_tokens_total", 0) == 2
    assert value(metrics, "vllm:generation_tokens_total", 1) == 4
    assert value(metrics, "vllm:prompt_tokens_by_source_total", 0, source="local_cache_hit") == 2
    snapshot = metrics.snapshot()
    assert snapshot[0] == EngineTotals(0, computed_prompt_tokens=6, generation_tokens=2)
    assert snapshot[1] == EngineTotals(1, computed_prompt_tokens=8, generation_tokens=4)
    assert metrics.engine_indexes == (0, 1)


# ---------------------------------------------------------------- registries


def test_default_registry_is_private() -> None:
    before = prometheus_client.generate_latest(prometheus_client.REGISTRY)
    first, second = Metrics(model_name="same"), Metrics(model_name="same")
    assert first.registry is not second.registry
    assert first.registry is not prometheus_client.REGISTRY
    for metrics in (first, second):
        tracker = metrics.tracker(engine_index=0, arrival_time=1.0, prompt_len=1, max_tokens=1)
        tracker.observe_output(2.0, 1.5, output([1]))
        tracker.record_finished(2.0, "length")
        assert value(metrics, "vllm:request_success_total", 0, finished_reason="length") == 1
    after = prometheus_client.generate_latest(prometheus_client.REGISTRY)
    assert b"vllm:" not in after
    assert after.count(b"\n# TYPE") == before.count(b"\n# TYPE")


def test_shared_registry_detects_clashes_and_unregisters() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = Metrics(registry, model_name="x")
    assert metrics.registry is registry
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Metrics(registry)
    metrics.unregister()
    again = Metrics(registry)
    again.observe_scheduler_stats(0, SchedulerStats(num_running_reqs=1))
    assert registry.get_sample_value(
        "vllm:num_requests_running", {"model_name": "anyio-genout", "engine": "0"}) == 1


def test_created_series_are_hidden_without_touching_the_process_setting() -> None:
    metrics = Metrics()
    metrics.tracker(engine_index=0, arrival_time=0.0, prompt_len=1, max_tokens=None)
    assert b"_created" not in prometheus_client.generate_latest(metrics.registry)
    plain = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter("plain_counter", "doc", registry=plain)
    counter.inc()
    assert b"plain_counter_created" in prometheus_client.generate_latest(plain)


def test_max_model_len_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        Metrics(max_model_len=0)


# ---------------------------------------------------------------- buckets


def bucket_bounds(metrics: Metrics, name: str) -> list[float]:
    for family in metrics.registry.collect():
        if family.name == name:
            return sorted({float(s.labels["le"]) for s in family.samples
                           if s.name == name + "_bucket"})
    raise AssertionError(name)


def test_bucket_boundaries_equal_vllm() -> None:
    # vllm/v1/metrics/buckets.py
    assert TIME_TO_FIRST_TOKEN_BUCKETS == (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
    assert INTER_TOKEN_LATENCY_BUCKETS == (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0)
    assert REQUEST_LATENCY_BUCKETS == (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
    assert REQUEST_PARAMS_N_BUCKETS == (1.0, 2.0, 5.0, 10.0, 20.0)
    assert REQUEST_NUM_PREEMPTIONS_BUCKETS == (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
    assert build_1_2_5_buckets(100) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    # vLLM does not append max_model_len itself: 131072 ends at 100000.
    assert build_1_2_5_buckets(131072) == (
        1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
        10000.0, 20000.0, 50000.0, 100000.0)
    assert build_1_2_5_buckets(1) == (1.0,)
    assert build_buckets([1, 3], 40) == (1.0, 3.0, 10.0, 30.0)
    with pytest.raises(ValueError, match="mantissas"):
        build_buckets([], 10)


def test_histograms_use_the_vllm_buckets() -> None:
    metrics = Metrics(max_model_len=4096)
    metrics.tracker(engine_index=0, arrival_time=0.0, prompt_len=1, max_tokens=None)
    expected = {
        "vllm:time_to_first_token_seconds": TIME_TO_FIRST_TOKEN_BUCKETS,
        "vllm:inter_token_latency_seconds": INTER_TOKEN_LATENCY_BUCKETS,
        "vllm:request_time_per_output_token_seconds": INTER_TOKEN_LATENCY_BUCKETS,
        "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
        "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
        "vllm:request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
        "vllm:request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
        "vllm:request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
        "vllm:request_params_n": REQUEST_PARAMS_N_BUCKETS,
        "vllm:request_num_preemptions": REQUEST_NUM_PREEMPTIONS_BUCKETS,
    }
    tokens = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    for name in ("request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens", "request_params_max_tokens",
                 "request_prefill_kv_computed_tokens"):
        expected[f"vllm:{name}"] = tokens
    for name, bounds in expected.items():
        assert bucket_bounds(metrics, name) == [*map(float, bounds), math.inf], name
