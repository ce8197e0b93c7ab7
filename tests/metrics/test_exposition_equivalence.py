"""The metrics are plain numbers exposed at scrape time; they must match prometheus-client's own.

Each test feeds the same values to a :class:`Metrics` (through its public API) and to a
reference ``prometheus_client.Histogram`` / ``Counter``, and compares the samples exactly:
bucket placement at the bounds, NaN (summed, never counted), infinities, value types.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterable

import prometheus_client
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anyio_genout.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    Metrics,
    build_1_2_5_buckets,
)
from anyio_genout.protocol.outputs import EngineCoreOutput, PrefillStats, SchedulerStats

Samples = dict[tuple[str, str | None], float]


def samples(metrics: Metrics, family: str, engine: int) -> Samples:
    """``{(sample name, le): value}`` of one engine's series of ``family``."""
    for metric in metrics.registry.collect():
        if metric.name == family:
            return {(s.name, s.labels.get("le")): s.value for s in metric.samples
                    if s.labels["engine"] == str(engine)}
    raise AssertionError(family)


def reference(family: str, buckets: Iterable[float], values: Iterable[float]) -> Samples:
    histogram = prometheus_client.Histogram(family, "reference", buckets=tuple(buckets),
                                            registry=None)
    for value in values:
        histogram.observe(value)
    [metric] = histogram.collect()
    return {(s.name, s.labels.get("le")): s.value for s in metric.samples
            if not s.name.endswith("_created")}


def assert_same(actual: Samples, expected: Samples) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        got = actual[key]
        assert type(got) is type(value), key
        assert got == value or (math.isnan(got) and math.isnan(value)), (key, got, value)


def token() -> EngineCoreOutput:
    return EngineCoreOutput("r", [1])


def test_inter_token_latency_matches_prometheus_client() -> None:
    """Bounds hit exactly, repeats (the remembered bucket), clock jumps, inf and NaN."""
    gaps = [0.5, 0.5, 0.5, 0.75, 0.75, 1.0, 2.5, 0.25, 0.25, 80.0, 100.0, 0.0, -0.5, 0.01,
            0.01, 0.0078125, 5.0, 7.5, 10.0, 20.0, 40.0]
    stamps = [1.0]
    for gap in gaps:
        stamps.append(stamps[-1] + gap)
    stamps += [math.inf, 3.0, math.nan, 5.0, 5.5, 6.0, 0.0, 1.0, 1.5, math.nan, math.nan, 7.0,
               7.5]
    metrics = Metrics()
    # Three requests on one engine, offset, so the engine sees interleaved and shared values.
    expected: list[float] = []
    trackers = [metrics.tracker(engine_index=0, arrival_time=0.0, prompt_len=1, max_tokens=None)
                for _ in range(3)]
    for step in range(len(stamps) + 2):
        for offset, tracker in enumerate(trackers):
            index = step - offset
            if not 0 <= index < len(stamps):
                continue
            last = tracker.last_token_ts
            ts = stamps[index]
            if not tracker.is_prefilling and last > 0.0:
                expected.append(ts - last)
            tracker.observe_output(ts, 1.0, token())
    assert any(math.isnan(v) for v in expected)
    assert {math.inf, -math.inf} <= set(expected)
    name = "vllm:inter_token_latency_seconds"
    assert_same(samples(metrics, name, 0), reference(name, INTER_TOKEN_LATENCY_BUCKETS, expected))


def test_request_histograms_match_prometheus_client() -> None:
    rng = random.Random(7)
    max_model_len = 131072
    tokens = build_1_2_5_buckets(max_model_len)
    specials = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0]
    metrics = Metrics(max_model_len=max_model_len)
    e2e: list[float] = []
    prompts: list[float] = []
    max_tokens: list[float] = []
    for _ in range(300):
        arrival = rng.choice([100.0, 1000.0, 1e9])
        latency = rng.choice([*REQUEST_LATENCY_BUCKETS, *specials, rng.random() * 10,
                              rng.random() * 8000])
        received = arrival + latency
        prompt_len = rng.choice([*map(int, tokens), 0, 3, 131072, 10**7])
        limit = rng.choice([None, 1, 2, 4, 100000, 100001])
        tracker = metrics.tracker(engine_index=1, arrival_time=arrival, prompt_len=prompt_len,
                                  max_tokens=limit)
        tracker.record_finished(received, "stop")
        e2e.append(received - arrival)
        prompts.append(prompt_len)
        if limit is not None:
            max_tokens.append(limit)
    for name, bounds, values in [
        ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS, e2e),
        ("vllm:request_prompt_tokens", tokens, prompts),
        ("vllm:request_params_max_tokens", tokens, max_tokens),
    ]:
        assert_same(samples(metrics, name, 1), reference(name, bounds, values))
    assert metrics.registry.get_sample_value(
        "vllm:request_success_total",
        {"model_name": "anyio-genout", "engine": "1", "finished_reason": "stop"}) == 300.0


def test_first_token_latency_matches_prometheus_client() -> None:
    metrics = Metrics()
    latencies = [0.001, 0.005, 0.25, 0.5, 0.75, 2560.0, 3000.0, 0.0, math.nan, math.inf, -2.0]
    for latency in latencies:
        tracker = metrics.tracker(engine_index=0, arrival_time=0.0, prompt_len=1,
                                  max_tokens=None)
        tracker.observe_output(1.0, latency, token())
    name = "vllm:time_to_first_token_seconds"
    assert_same(samples(metrics, name, 0),
                reference(name, TIME_TO_FIRST_TOKEN_BUCKETS, latencies))


def test_counter_and_gauge_values_are_floats_like_prometheus_client() -> None:
    metrics = Metrics()
    tracker = metrics.tracker(engine_index=0, arrival_time=1.0, prompt_len=8, max_tokens=None)
    tracker.observe_output(2.0, 1.5, EngineCoreOutput("r", [1, 2, 3],
                                                      prefill_stats=PrefillStats(8, 6, 2, 2)))
    metrics.observe_scheduler_stats(0, SchedulerStats(num_running_reqs=3, kv_cache_usage=1))
    values = {s.name: s.value for m in metrics.registry.collect() for s in m.samples}
    assert values["vllm:generation_tokens_total"] == 3.0
    assert values["vllm:num_requests_running"] == 3.0
    assert values["vllm:kv_cache_usage_perc"] == 1.0
    assert {type(v) for v in values.values()} == {float}
    # The logger's totals keep the engine's numbers as given.
    totals = metrics.snapshot()[0]
    assert (totals.generation_tokens, totals.num_running, totals.kv_cache_usage) == (3, 3, 1)


def test_a_scrape_thread_never_fails_while_the_loop_records() -> None:
    """prometheus-client's HTTP server collects on its own thread, without any lock of ours."""
    metrics = Metrics()
    errors: list[BaseException] = []
    stop = threading.Event()

    def scrape() -> None:
        try:
            while not stop.is_set():
                prometheus_client.generate_latest(metrics.registry)
        except BaseException as exc:  # pragma: no cover - the failure being tested for
            errors.append(exc)

    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        for engine in range(40):
            for request in range(25):
                tracker = metrics.tracker(engine_index=engine, arrival_time=1.0,
                                          prompt_len=4, max_tokens=8)
                for step in range(5):
                    tracker.observe_output(2.0 + step * 0.02, 1.5, token())
                tracker.record_finished(3.0, f"reason-{request % 7}")
            metrics.observe_scheduler_stats(engine, SchedulerStats(prefix_cache_queries=1))
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert len(metrics.engine_indexes) == 40
    assert metrics.registry.get_sample_value(
        "vllm:inter_token_latency_seconds_count",
        {"model_name": "anyio-genout", "engine": "39"}) == 100.0


@pytest.mark.parametrize("max_model_len", [1, 100, 4096])
def test_describe_lists_every_family_without_samples(max_model_len: int) -> None:
    metrics = Metrics(max_model_len=max_model_len)
    described = {(m.name, m.type) for m in metrics._exposition.describe()}
    metrics.tracker(engine_index=0, arrival_time=0.0, prompt_len=1, max_tokens=None)
    collected = {(m.name, m.type) for m in metrics.registry.collect()}
    assert described == collected
    # vLLM's 27 and 11 more of vLLM 0.32's, anyio_genout:engine_up and :request_migrations
    assert len(described) == 40


_STAMPS = st.one_of(st.floats(min_value=-1.0, max_value=200.0), st.sampled_from(
    [0.0, 1.0, 1.5, math.inf, -math.inf, math.nan]))


@settings(max_examples=200, derandomize=True, deadline=None)
@given(stamps=st.lists(st.tuples(_STAMPS, st.integers(0, 3)), min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 6), min_size=1, max_size=40))
def test_a_run_of_steps_records_what_the_steps_one_by_one_record(
        stamps: list[tuple[float, int]], cuts: list[int]) -> None:
    """``observe_steps`` (a merged run of plain steps, one call) against ``observe_output``
    per step: the same counters, inter-token latency histogram (sum included: the same
    additions in the same order) and time to first token, whatever the batch timestamps
    (repeats, gaps of 0, clock jumps back, inf and NaN) and however the run is cut."""
    one, run = Metrics(), Metrics()
    single = one.tracker(engine_index=0, arrival_time=0.0, prompt_len=1, max_tokens=None)
    merged = run.tracker(engine_index=0, arrival_time=0.0, prompt_len=1, max_tokens=None)
    steps: list[object] = []
    for ts, n in stamps:
        output = EngineCoreOutput("r", list(range(n)))
        single.observe_output(ts, 1.0, output)
        steps += [ts, n]
    start, cut = 0, 0
    while start < len(steps):
        end = start + 2 * cuts[cut % len(cuts)]
        merged.observe_steps(steps[start:end], 1.0)
        start, cut = end, cut + 1
    assert (merged.num_generation_tokens, merged.is_prefilling) == \
        (single.num_generation_tokens, single.is_prefilling)
    assert merged.last_token_ts == single.last_token_ts or \
        (math.isnan(merged.last_token_ts) and math.isnan(single.last_token_ts))
    for family in ("vllm:inter_token_latency_seconds", "vllm:time_to_first_token_seconds",
                   "vllm:generation_tokens"):
        assert_same(samples(run, family, 0), samples(one, family, 0))
