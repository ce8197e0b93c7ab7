"""Finished requests' histograms are folded in batches: the same counts and sums as one
observation at a time, and nothing lost to a scrape running on another thread."""

from __future__ import annotations

import math
import threading

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from anyio_genout.metrics import Metrics
from anyio_genout.metrics.request import _FOLD_AT, _Histogram

_BOUNDS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
_VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64),
                    st.integers(-5, 10_000).map(float), st.sampled_from(_BOUNDS))


@given(first=st.lists(_VALUES, max_size=40), second=st.lists(_VALUES, max_size=40))
def test_a_batch_counts_and_sums_exactly_as_one_observation_at_a_time(
        first: list[float], second: list[float]) -> None:
    one_by_one, batched = _Histogram(_BOUNDS), _Histogram(_BOUNDS)
    for value in first + second:
        one_by_one.observe(value)
    batched.observe_many(np.array(first, dtype=np.float64))
    batched.observe_many(np.array(second, dtype=np.float64))
    assert batched.counts == one_by_one.counts
    # The very same float (NaN included): a running sum, not a pairwise one.
    assert (math.isnan(batched.sum) and math.isnan(one_by_one.sum)) or \
        batched.sum == one_by_one.sum


def _count(metrics: Metrics, name: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(f"{name}_count{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_requests_finished_while_another_thread_scrapes_are_all_counted() -> None:
    metrics = Metrics(model_name="fold-test", max_model_len=4096)
    total = 3 * _FOLD_AT + 17  # several batches folded by the loop, and a remainder
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
