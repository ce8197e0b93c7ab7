"""Prometheus metrics with vLLM's names, labels and buckets, and a periodic stats logger.

* :class:`Metrics` — the metric families in a (by default private) registry; per engine,
  :meth:`Metrics.observe_scheduler_stats` and :meth:`Metrics.tracker`.
* :class:`RequestTracker` — one request: :meth:`~RequestTracker.observe_output` per output,
  :meth:`~RequestTracker.record_finished` once.
* :func:`log_stats_periodically` — an optional task logging throughput and queue state.
* :mod:`.buckets` — vLLM's histogram bucket boundaries.

Modules: :mod:`.core` (:class:`Metrics`), :mod:`.tracker` (:class:`RequestTracker`),
:mod:`.series` (one engine's recorded values), :mod:`.histogram` (a histogram as plain
numbers, folded in batches), :mod:`.exposition` (the collector building the families),
:mod:`.steps` (vLLM 0.32's per-step families beyond the first 27), :mod:`.labels` (label
names and values), :mod:`.buckets`, :mod:`.logger`.
"""

from .buckets import (
    INTER_TOKEN_LATENCY_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    build_1_2_5_buckets,
    build_buckets,
)
from .core import Metrics
from .labels import FINISHED_REASONS, PROMPT_TOKEN_SOURCES, WAITING_REASONS, finish_reason_label
from .logger import StatsSummary, log_stats_periodically, summarize_stats
from .series import EngineTotals
from .tracker import RequestTracker

__all__ = [
    "FINISHED_REASONS",
    "INTER_TOKEN_LATENCY_BUCKETS",
    "ITERATION_TOKENS_BUCKETS",
    "PROMPT_TOKEN_SOURCES",
    "REQUEST_LATENCY_BUCKETS",
    "REQUEST_NUM_PREEMPTIONS_BUCKETS",
    "REQUEST_PARAMS_N_BUCKETS",
    "TIME_TO_FIRST_TOKEN_BUCKETS",
    "WAITING_REASONS",
    "EngineTotals",
    "Metrics",
    "RequestTracker",
    "StatsSummary",
    "build_1_2_5_buckets",
    "build_buckets",
    "finish_reason_label",
    "log_stats_periodically",
    "summarize_stats",
]
