"""One engine's recorded values: the counters, gauges and histograms of its series.

:class:`EngineSeries` holds, for one engine index of a :class:`~.core.Metrics`, every value
the exposition reads: a counter is an ``int`` attribute, a gauge a ``float``, a histogram a
:class:`~.histogram.Histogram` (``vllm:inter_token_latency_seconds``, recorded once per
output, flattened into the series). The :class:`~.tracker.RequestTracker` writes the
per-output values directly; a finished request's values are queued as one row
(:meth:`EngineSeries.record_finished`, beside ``EngineSeries.FINISH_COLUMNS``, the one
place that knows the row's column order) and folded in with numpy a batch at a time
(:meth:`EngineSeries.fold`).

Threads: the event loop appends; :meth:`EngineSeries.fold` may run on a scrape thread. It
takes a lock (the loop skips its own fold while a scrape folds), and each queued row is taken
exactly once.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import ClassVar, Final

import attrs
import numpy as np

from ..protocol.outputs import PrefillStats, SchedulerStats
from .buckets import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
)
from .histogram import Histogram
from .labels import FINISHED_REASONS
from .steps import StepSeries

__all__ = ["FOLD_AT", "EngineSeries", "EngineTotals"]

#: Finished requests queued per engine before the loop folds them in itself.
FOLD_AT: Final = 1024


@attrs.frozen
class EngineTotals:
    """Running totals for one engine, as read by the periodic stats logger.

    Counters are cumulative since the :class:`~.core.Metrics` object was created; the gauges
    hold the latest scheduler statistics (all zero until the first, see
    ``has_scheduler_stats``).
    """

    engine_index: int
    #: Prompt tokens prefilled locally (``vllm:prompt_tokens_by_source{source="local_compute"}``).
    computed_prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_running: int = 0
    #: Capacity-waiting plus deferred requests, as ``vllm:num_requests_waiting``.
    num_waiting: int = 0
    #: 0..1 (``vllm:kv_cache_usage_perc``).
    kv_cache_usage: float = 0.0
    has_scheduler_stats: bool = False


class EngineSeries:
    """One engine's recorded values: counters (ints), gauges (floats), histograms.

    The counters double as the logger's running totals (``generation_tokens``,
    ``prompt_local_compute``, ``prefix_cache_queries``, ``prefix_cache_hits``).
    """

    __slots__ = (
        "_fold_lock",
        "_success_order",
        "decode_time",
        "e2e_request_latency",
        "engine_index",
        "finished",
        "gauge_kv_cache_usage",
        "gauge_running",
        "gauge_waiting",
        "gauge_waiting_capacity",
        "gauge_waiting_deferred",
        "generation_tokens",
        "has_scheduler_stats",
        "inference_time",
        "itl_counts",
        "itl_hi",
        "itl_last_bucket",
        "itl_lo",
        "itl_sum",
        "labels",
        "last_kv_cache_usage",
        "last_running",
        "last_waiting",
        "num_preemptions",
        "prefill_time",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "prompt_external_kv_transfer",
        "prompt_local_cache_hit",
        "prompt_local_compute",
        "prompt_tokens",
        "prompt_tokens_cached",
        "queue_time",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "request_num_preemptions",
        "request_params_max_tokens",
        "request_params_n",
        "request_prefill_kv_computed_tokens",
        "request_prompt_tokens",
        "steps",
        "success",
        "time_per_output_token",
        "time_to_first_token",
    )

    def __init__(self, model_name: str, engine_index: int, token_bounds: tuple[float, ...],
                 success_order: list[tuple[EngineSeries, str]]) -> None:
        self.engine_index = engine_index
        self.labels = (model_name, str(engine_index))
        #: ``vllm:request_success`` per ``finished_reason``; ``success_order`` (shared by the
        #: engines of one :class:`Metrics`) lists the series in order of creation.
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        self._success_order = success_order
        success_order.extend((self, reason) for reason in FINISHED_REASONS)
        self.prompt_tokens = 0
        self.prompt_local_compute = 0
        self.prompt_local_cache_hit = 0
        self.prompt_external_kv_transfer = 0
        self.prompt_tokens_cached = 0
        self.generation_tokens = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.gauge_running = 0.0
        self.gauge_waiting = 0.0
        self.gauge_waiting_capacity = 0.0
        self.gauge_waiting_deferred = 0.0
        self.gauge_kv_cache_usage = 0.0
        # The latest scheduler statistics as received (the gauges hold them as floats).
        self.last_running = 0
        self.last_waiting = 0
        self.last_kv_cache_usage = 0.0
        self.has_scheduler_stats = False
        self.time_to_first_token = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        # vllm:inter_token_latency_seconds, the per-output histogram, is flattened into the
        # series (a Histogram's counts and sum) to save an attribute load per output, plus
        # the bucket of the latest value observed and its bounds: a value v with
        # itl_lo < v <= itl_hi counts there without a search (NaN bounds: not yet any).
        self.itl_counts = [0] * (len(INTER_TOKEN_LATENCY_BUCKETS) + 1)
        self.itl_sum = 0.0
        self.itl_lo = math.nan
        self.itl_hi = math.nan
        self.itl_last_bucket = 0
        self.e2e_request_latency = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(token_bounds)
        self.request_generation_tokens = Histogram(token_bounds)
        self.request_max_num_generation_tokens = Histogram(token_bounds)
        self.request_params_max_tokens = Histogram(token_bounds)
        self.request_params_n = Histogram(REQUEST_PARAMS_N_BUCKETS)
        self.request_num_preemptions = Histogram(REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.request_prefill_kv_computed_tokens = Histogram(token_bounds)
        #: The per-step families beyond the first 27 (:mod:`.steps`).
        self.steps = StepSeries()
        #: Finished requests' rows (:meth:`record_finished`), not yet folded in. Appending
        #: is all a finish costs the event loop; folding a batch with numpy costs a fraction
        #: of observing each value (docs/performance.md).
        self.finished: deque[tuple[float, ...]] = deque()
        self._fold_lock = threading.Lock()

    def fold(self, *, wait: bool = True) -> None:
        """Fold the queued finished requests into their histograms.

        Called by the collector before reading the histograms (from any thread) and by the
        event loop every ``FOLD_AT`` requests; ``wait=False`` skips the fold if another
        thread is folding. Each queued row is taken exactly once, so appends made meanwhile
        are never lost.
        """
        if not self._fold_lock.acquire(blocking=wait):
            return
        try:
            queue = self.finished
            rows = [queue.popleft() for _ in range(len(queue))]
            if not rows:
                return
            table = np.array(rows, dtype=np.float64)
            for column, name in enumerate(self.FINISH_COLUMNS):
                values = table[:, column]
                if column == self._MAX_TOKENS_COLUMN:
                    values = values[~np.isnan(values)]
                histogram: Histogram = getattr(self, name)
                histogram.observe_many(values)
        finally:
            self._fold_lock.release()

    #: The histograms a finished request's row fills, in the order of the row's values, which
    #: :meth:`record_finished` (right below) writes: the one place that knows the order.
    FINISH_COLUMNS: ClassVar[tuple[str, ...]] = (
        "e2e_request_latency", "queue_time", "prefill_time", "decode_time", "inference_time",
        "time_per_output_token", "request_prompt_tokens", "request_generation_tokens",
        "request_max_num_generation_tokens", "request_params_max_tokens", "request_params_n",
        "request_prefill_kv_computed_tokens", "request_num_preemptions",
    )
    #: Column of ``vllm:request_params_max_tokens``, where NaN means "not observed" (a request
    #: without max_tokens); its values are otherwise whole numbers, never NaN.
    _MAX_TOKENS_COLUMN: ClassVar[int] = FINISH_COLUMNS.index("request_params_max_tokens")

    def record_finished(
        self,
        reason: str,
        e2e_latency: float,
        queued_ts: float,
        scheduled_ts: float,
        first_token_ts: float,
        last_token_ts: float,
        generation_tokens: int,
        prompt_len: int,
        max_tokens: int | None,
        cached_tokens: int,
        preemptions: int,
    ) -> None:
        """One request's end: +1 on ``vllm:request_success`` for ``reason`` (an unknown reason
        gets a new series), and its per-request histogram values, queued as one row.

        The timestamps are the engine's (0 where not seen); ``cached_tokens`` is the
        ``num_cached_tokens`` of its latest prefill stats; ``max_tokens`` None observes no
        ``vllm:request_params_max_tokens``.
        """
        success = self.success
        count = success.get(reason)
        if count is None:
            success[reason] = 1
            self._success_order.append((self, reason))
        else:
            success[reason] = count + 1
        decode = _dz(last_token_ts, first_token_ts)
        per_token = decode / (generation_tokens - 1) if generation_tokens > 1 else 0.0
        finished = self.finished
        finished.append((  # in FINISH_COLUMNS order:
            e2e_latency,  # e2e_request_latency
            _dz(scheduled_ts, queued_ts),  # queue_time
            _dz(first_token_ts, scheduled_ts),  # prefill_time
            decode,  # decode_time
            _dz(last_token_ts, scheduled_ts),  # inference_time
            per_token,  # time_per_output_token
            prompt_len,  # request_prompt_tokens
            generation_tokens,  # request_generation_tokens
            generation_tokens,  # request_max_num_generation_tokens
            math.nan if max_tokens is None else max_tokens,  # request_params_max_tokens
            1,  # request_params_n
            max(0, prompt_len - cached_tokens),  # request_prefill_kv_computed_tokens
            preemptions,  # request_num_preemptions
        ))
        if len(finished) >= FOLD_AT:
            self.fold(wait=False)

    def record_prompt(self, stats: PrefillStats) -> None:
        """Prompt-token counters from a request's first token-bearing output."""
        if stats.num_prompt_tokens > 0:
            self.prompt_tokens += stats.num_prompt_tokens
        if stats.num_computed_tokens > 0:
            self.prompt_local_compute += stats.num_computed_tokens
        if stats.num_local_cached_tokens > 0:
            self.prompt_local_cache_hit += stats.num_local_cached_tokens
        if stats.num_external_cached_tokens > 0:
            self.prompt_external_kv_transfer += stats.num_external_cached_tokens
        if stats.num_cached_tokens > 0:
            self.prompt_tokens_cached += stats.num_cached_tokens

    def observe_scheduler_stats(self, stats: SchedulerStats) -> None:
        """One engine step's scheduler statistics (see :meth:`.Metrics.observe_scheduler_stats`)."""
        running = stats.num_running_reqs
        waiting = stats.num_waiting_reqs
        deferred = stats.num_skipped_waiting_reqs
        usage = stats.kv_cache_usage
        self.gauge_running = float(running)
        self.gauge_waiting = float(waiting + deferred)
        self.gauge_waiting_capacity = float(waiting)
        self.gauge_waiting_deferred = float(deferred)
        self.gauge_kv_cache_usage = float(usage)
        self.last_running = running
        self.last_waiting = waiting + deferred
        self.last_kv_cache_usage = usage
        self.has_scheduler_stats = True
        queries = stats.prefix_cache_queries
        if queries > 0:
            self.prefix_cache_queries += queries
        hits = stats.prefix_cache_hits
        if hits > 0:
            self.prefix_cache_hits += hits
        self.steps.observe(hits, stats.raw)

    def totals(self) -> EngineTotals:
        return EngineTotals(
            self.engine_index,
            self.prompt_local_compute,
            self.generation_tokens,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.last_running,
            self.last_waiting,
            self.last_kv_cache_usage,
            self.has_scheduler_stats,
        )


def _dz(end: float, start: float) -> float:
    """``end - start`` when both timestamps were seen (> 0) and ordered, else 0."""
    if start > 0.0 and end > 0.0 and end >= start:
        return end - start
    return 0.0
