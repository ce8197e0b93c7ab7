"""An optional periodic stats log line, like ``vllm serve``'s, from a :class:`Metrics` object.

Run :func:`log_stats_periodically` as a task in the client's task group; it logs one line per
interval until cancelled::

    Avg prompt tput: 1234.5 toks/s, Avg generation tput: 678.9 toks/s, Reqs Running: 8,
    Waiting: 2, GPU KV cache used: 41.2%, Prefix cache hit rate: 37.5%

(on one line). Throughputs are counter deltas over the elapsed time (prompt = locally computed
prompt tokens); running and waiting are summed over engines, KV-cache usage averaged over the
engines that have reported scheduler statistics, and the hit rate is the interval's
Δhits / Δqueries. An idle line (no throughput now or in the previous interval) is logged at
DEBUG, others at INFO.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final

import anyio
import attrs
from anyio.abc import TaskStatus

from .core import Metrics
from .series import EngineTotals

__all__ = ["StatsSummary", "log_stats_periodically", "summarize_stats"]

_LOGGER: Final = logging.getLogger("anyio_genout.metrics")
_FORMAT: Final = (
    "Avg prompt tput: %.1f toks/s, Avg generation tput: %.1f toks/s, Reqs Running: %d, "
    "Waiting: %d, GPU KV cache used: %.1f%%, Prefix cache hit rate: %.1f%%"
)


@attrs.frozen
class StatsSummary:
    """One logging interval, aggregated over engines."""

    prompt_throughput: float
    generation_throughput: float
    num_running: int
    num_waiting: int
    #: Percent (0..100), averaged over the engines that have reported scheduler statistics.
    kv_cache_usage_percent: float
    #: Percent (0..100) over the interval; 0 when there were no queries.
    prefix_cache_hit_rate: float

    def format_args(self) -> tuple[float, float, int, int, float, float]:
        """The arguments for the log format string."""
        return (self.prompt_throughput, self.generation_throughput, self.num_running,
                self.num_waiting, self.kv_cache_usage_percent, self.prefix_cache_hit_rate)

    def message(self) -> str:
        """The log line."""
        return _FORMAT % self.format_args()


def summarize_stats(
    previous: Mapping[int, EngineTotals],
    current: Mapping[int, EngineTotals],
    elapsed: float,
) -> StatsSummary:
    """Aggregate two :meth:`Metrics.snapshot` results taken ``elapsed`` seconds apart.

    Engines missing from ``previous`` (first seen during the interval) count from zero.
    """
    prompt = generation = queries = hits = 0
    running = waiting = 0
    usage = 0.0
    reporting = 0
    for index, now in current.items():
        before = previous.get(index)
        if before is None:
            before = EngineTotals(index)
        prompt += now.computed_prompt_tokens - before.computed_prompt_tokens
        generation += now.generation_tokens - before.generation_tokens
        queries += now.prefix_cache_queries - before.prefix_cache_queries
        hits += now.prefix_cache_hits - before.prefix_cache_hits
        if now.has_scheduler_stats:
            running += now.num_running
            waiting += now.num_waiting
            usage += now.kv_cache_usage
            reporting += 1
    return StatsSummary(
        prompt / elapsed if elapsed > 0 else 0.0,
        generation / elapsed if elapsed > 0 else 0.0,
        running,
        waiting,
        usage / reporting * 100.0 if reporting else 0.0,
        hits / queries * 100.0 if queries > 0 else 0.0,
    )


async def log_stats_periodically(
    metrics: Metrics,
    *,
    interval: float = 10.0,
    logger: logging.Logger | None = None,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Log a throughput/queue summary every ``interval`` seconds until cancelled.

    The first line comes one interval after the start (no line at time zero). Lines go to
    ``logger`` (default ``anyio_genout.metrics``) at INFO, or DEBUG when the client was idle
    both in this interval and the previous one. With ``await task_group.start(...)`` the call
    returns once the baseline snapshot is taken.

    Raises :class:`ValueError` (before anything is logged) if ``interval`` is not positive.
    """
    if not interval > 0:
        raise ValueError(f"interval must be positive, got {interval!r}")
    log = _LOGGER if logger is None else logger
    previous = metrics.snapshot()
    last_time = anyio.current_time()
    last_prompt = last_generation = 0.0
    task_status.started()
    while True:
        await anyio.sleep(interval)
        now = anyio.current_time()
        current = metrics.snapshot()
        summary = summarize_stats(previous, current, now - last_time)
        idle = not (summary.prompt_throughput or summary.generation_throughput
                    or last_prompt or last_generation)
        log.log(logging.DEBUG if idle else logging.INFO, _FORMAT, *summary.format_args())
        previous, last_time = current, now
        last_prompt, last_generation = summary.prompt_throughput, summary.generation_throughput
