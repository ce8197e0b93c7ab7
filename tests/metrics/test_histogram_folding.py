"""Finished requests' histograms are folded in batches: the same counts and sums as one
observation at a time, and nothing lost to a scrape running on another thread."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from anyio_genout.metrics import Metrics
from anyio_genout.metrics.histogram import Histogram
from anyio_genout.metrics.series import FOLD_AT

_BOUNDS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
# Finite values only: what the folded histograms receive from engines is finite (the decoder
# refuses non-finite timestamps, tests/protocol/test_output_timestamps.py); NaN, infinities
# and overflow are pinned below instead of left for hypothesis to find some day.
_VALUES = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=64),
                    st.integers(-5, 10_000).map(float), st.sampled_from(_BOUNDS))


def _assert_folds_like_one_at_a_time(first: list[float], second: list[float]) -> None:
    one_by_one, batched = Histogram(_BOUNDS), Histogram(_BOUNDS)
    for value in first + second:
        one_by_one.observe(value)
    batched.observe_many(np.array(first, dtype=np.float64))
    batched.observe_many(np.array(second, dtype=np.float64))
    assert batched.counts == one_by_one.counts
    # The very same float (NaN included): a running sum, not a pairwise one.
    assert (math.isnan(batched.sum) and math.isnan(one_by_one.sum)) or \
        batched.sum == one_by_one.sum


@settings(derandomize=True, database=None, max_examples=200, deadline=None)
@given(first=st.lists(_VALUES, max_size=40), second=st.lists(_VALUES, max_size=40))
def test_a_batch_counts_and_sums_exactly_as_one_observation_at_a_time(
        first: list[float], second: list[float]) -> None:
    _assert_folds_like_one_at_a_time(first, second)


@pytest.mark.parametrize(("first", "second"), [
    ([math.nan], [1.0]),
    ([math.inf], [0.5]),
    ([-math.inf, 0.01], []),
    ([math.inf, -math.inf], []),  # the sum becomes NaN: numpy would warn "invalid value"
    ([math.inf], [-math.inf, 2.0]),  # the same across two batches
    ([1.7e308, 1.7e308], [-1.0]),  # the sum overflows: numpy would warn "overflow"
    ([math.nan, 5.0, math.inf, 10.0], [math.nan]),
], ids=["nan", "inf", "-inf", "inf-inf", "inf|-inf", "overflow", "mixed"])
def test_special_values_fold_exactly_and_silently(first: list[float],
                                                  second: list[float]) -> None:
    """Python's float sum turns these into inf or NaN without a word; so must a fold, since a
    scrape folds (and pytest's filterwarnings=error would turn a numpy warning into a
    failure, as a user's warnings filter might)."""
    _assert_folds_like_one_at_a_time(first, second)


def _count(metrics: Metrics, name: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(f"{name}_count{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_requests_finished_while_another_thread_scrapes_are_all_counted() -> None:
    metrics = Metrics(model_name="fold-test", max_model_len=4096)
    total = 3 * FOLD_AT + 17  # several batches folded by the loop, and a remainder
    stop = threading.Event()
    scrapes = 0

    def scrape() -> None:
        nonlocal scrapes
        while not stop.is_set():
            generate_latest(metrics.registry)
            scrapes += 1

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for i in range(total):
            tracker = metrics.tracker(engine_index=0, arrival_time=100.0, prompt_len=16,
                                      max_tokens=None if i % 2 else 8)
            tracker.record_finished(100.5, "length")
    finally:
        stop.set()
        scraper.join()
    assert scrapes > 0
    assert _count(metrics, "vllm:e2e_request_latency_seconds") == total
    assert _count(metrics, "vllm:request_params_n") == total
    # max_tokens is observed only for the requests that had one.
    assert _count(metrics, "vllm:request_params_max_tokens") == (total + 1) // 2
