"""Prometheus metrics with vLLM's names, labels and buckets, recorded by the client.

:class:`Metrics` owns, per engine index, the recorded state (:class:`~.series.EngineSeries`)
and exposes it through one custom collector (:class:`~.exposition.Exposition`, in a private
:class:`CollectorRegistry` unless one is given). Each request gets a
:class:`~.tracker.RequestTracker` (:meth:`Metrics.tracker`), which records per output and
once at the end; recording touches plain Python numbers only, and the metric families are
built when the registry is collected.

Threads: recording happens on the event loop's thread; a scrape may run on another one
(``prometheus_client.start_http_server``): see :mod:`.exposition` and :mod:`.series` for
why that is safe. Values live in this process only (no prometheus multiprocess mode).

Scheduler statistics (:meth:`Metrics.observe_scheduler_stats`) set the per-engine gauges and
add the step's prefix-cache increments. The same per-engine numbers feed the periodic logger
(:meth:`Metrics.snapshot`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from ..protocol.outputs import SchedulerStats
from .buckets import build_1_2_5_buckets
from .exposition import Exposition
from .series import EngineSeries, EngineTotals
from .steps import SleepState
from .tracker import RequestTracker

__all__ = ["Metrics"]


class Metrics:
    """vLLM's front-end Prometheus metrics for one client (one model name).

    ``registry=None`` creates a private :class:`CollectorRegistry` (never the global
    ``REGISTRY``); pass one to share it (two :class:`Metrics` on one registry clash:
    ``ValueError``). Expose it with ``prometheus_client.generate_latest(metrics.registry)``.

    Metric names, label names (``model_name``, ``engine``, then ``finished_reason`` /
    ``source`` / ``reason``), documentation and buckets are vLLM's, so dashboards for
    ``vllm serve`` work unchanged. Per-engine series appear (at zero) the first time an engine
    index is seen. The ``_created`` series are not exposed.

    Raises :class:`ValueError` if ``max_model_len`` is below 1, and
    ``prometheus_client``'s ``DuplicateTimeseries`` (a :class:`ValueError`) if ``registry``
    already holds the families (another :class:`Metrics` on it).
    """

    __slots__ = ("_engines", "_exposition", "_max_model_len", "_migrations", "_model_name",
                 "_registry", "_sleep", "_success_order", "_token_bounds", "_up")

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        model_name: str = "anyio-genout",
        max_model_len: int = 131072,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        self._registry = CollectorRegistry() if registry is None else registry
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._token_bounds = build_1_2_5_buckets(max_model_len)
        self._engines: dict[int, EngineSeries] = {}
        self._success_order: list[tuple[EngineSeries, str]] = []
        self._up: dict[int, float] = {}
        self._migrations: dict[int, int] = {}
        self._sleep = SleepState()
        self._exposition = Exposition(self._engines, self._token_bounds, self._success_order,
                                      self._up, str(model_name), self._migrations,
                                      self._sleep)
        self._registry.register(self._exposition)

    @property
    def registry(self) -> CollectorRegistry:
        """The registry the metrics are exposed through."""
        return self._registry

    @property
    def model_name(self) -> str:
        """The ``model_name`` label value."""
        return self._model_name

    @property
    def max_model_len(self) -> int:
        """The cap of the token-count histogram buckets."""
        return self._max_model_len

    @property
    def engine_indexes(self) -> tuple[int, ...]:
        """Engine indexes seen so far, in order of first appearance."""
        return tuple(self._engines)

    def unregister(self) -> None:
        """Remove the metrics from :attr:`registry` (useful with a shared registry).

        Raises :class:`KeyError` if they are not registered there (already removed).
        """
        self._registry.unregister(self._exposition)

    def _engine(self, engine_index: int) -> EngineSeries:
        series = self._engines.get(engine_index)
        if series is None:
            series = self._engines[engine_index] = EngineSeries(
                str(self._model_name), engine_index, self._token_bounds, self._success_order)
        return series

    def tracker(
        self,
        *,
        engine_index: int,
        arrival_time: float,
        prompt_len: int,
        max_tokens: int | None,
    ) -> RequestTracker:
        """A tracker for one request sent to ``engine_index``.

        ``arrival_time`` is the front end's ``time.time()`` when the request arrived;
        ``max_tokens`` ``None`` skips ``vllm:request_params_max_tokens``.
        """
        return RequestTracker(self._engine(engine_index), arrival_time, prompt_len, max_tokens)

    def observe_scheduler_stats(self, engine_index: int, stats: SchedulerStats) -> None:
        """Record one engine step's scheduler statistics.

        Sets ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (capacity-waiting
        plus deferred), ``vllm:num_requests_waiting_by_reason`` and
        ``vllm:kv_cache_usage_perc``; adds the step's prefix-cache queries and hits (the engine
        sends per-step increments, not totals) to ``vllm:prefix_cache_queries`` /
        ``vllm:prefix_cache_hits``.
        """
        self._engine(engine_index).observe_scheduler_stats(stats)

    def observe_iteration(self, engine_index: int, tokens: int) -> None:
        """One batch of outputs from ``engine_index``: observe ``tokens`` (the prompt tokens
        computed for the requests prefilled in it plus the tokens generated) in
        ``vllm:iteration_tokens_total``, as vLLM does once per ``EngineCoreOutputs``."""
        self._engine(engine_index).steps.iteration_tokens.observe(tokens)

    def record_sleep_state(self, sleep: int, level: int) -> None:
        """Set ``vllm:engine_sleep_state`` of every engine: ``sleep`` 1 after the engines
        were put to sleep at ``level``, 0 once fully awake (vLLM's ``record_sleep_state``)."""
        self._sleep.record(sleep, level)

    @property
    def sleep_state(self) -> dict[str, float]:
        """``vllm:engine_sleep_state`` by ``sleep_state`` label (the same for every engine)."""
        return dict(zip(("awake", "weights_offloaded", "discard_all"), self._sleep.values,
                        strict=True))

    def set_engine_up(self, engine_index: int, up: bool) -> None:
        """Set ``anyio_genout:engine_up{engine=...}`` (ours, not vLLM's): 1 while the
        engine is up, 0 once it is down (the client's health listener calls this)."""
        self._up[engine_index] = 1.0 if up else 0.0

    def record_migration(self, tracker: RequestTracker, from_engine: int,
                         to_engine: int) -> None:
        """A request moved from the dead engine ``from_engine`` to ``to_engine``: count it in
        ``anyio_genout:request_migrations_total{engine=from_engine}`` (ours, not vLLM's) and
        record the rest of ``tracker``'s request under ``to_engine`` (its tokens, latencies
        and its ``request_success``; what ``from_engine`` made stays counted there)."""
        self._migrations[from_engine] = self._migrations.get(from_engine, 0) + 1
        tracker.move_to(self._engine(to_engine))

    @property
    def migrations(self) -> dict[int, int]:
        """``anyio_genout:request_migrations_total`` so far, by the engine that died."""
        return dict(self._migrations)

    @property
    def engines_up(self) -> dict[int, bool]:
        """The ``anyio_genout:engine_up`` values set so far, by engine index."""
        return {index: value == 1.0 for index, value in self._up.items()}

    def snapshot(self) -> dict[int, EngineTotals]:
        """The running totals of every engine seen so far (cheap: no registry collection)."""
        return {index: series.totals() for index, series in self._engines.items()}
