"""The periodic stats logger (§3.15): aggregation, line format, levels, cadence."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Iterator

import anyio
import pytest

from anyio_genout.metrics import (
    EngineTotals,
    Metrics,
    StatsSummary,
    log_stats_periodically,
    summarize_stats,
)
from anyio_genout.protocol.outputs import EngineCoreOutput, PrefillStats, SchedulerStats

LOGGER = "tests.metrics.stats"
LINE = re.compile(
    r"Avg prompt tput: \d+\.\d toks/s, Avg generation tput: \d+\.\d toks/s, "
    r"Reqs Running: \d+, Waiting: \d+, GPU KV cache used: \d+\.\d%, "
    r"Prefix cache hit rate: \d+\.\d%"
)


def test_summary_line_format() -> None:
    summary = StatsSummary(12.0, 3.45, 3, 2, 45.0, 25.0)
    assert summary.message() == (
        "Avg prompt tput: 12.0 toks/s, Avg generation tput: 3.5 toks/s, Reqs Running: 3, "
        "Waiting: 2, GPU KV cache used: 45.0%, Prefix cache hit rate: 25.0%"
    )


def test_summarize_aggregates_engines() -> None:
    previous = {
        0: EngineTotals(0, computed_prompt_tokens=100, generation_tokens=10,
                        prefix_cache_queries=100, prefix_cache_hits=50),
        1: EngineTotals(1, generation_tokens=5),
    }
    current = {
        0: EngineTotals(0, computed_prompt_tokens=300, generation_tokens=30,
                        prefix_cache_queries=200, prefix_cache_hits=60, num_running=2,
                        num_waiting=1, kv_cache_usage=0.2, has_scheduler_stats=True),
        1: EngineTotals(1, generation_tokens=25, prefix_cache_queries=100,
                        prefix_cache_hits=30, num_running=3, num_waiting=4,
                        kv_cache_usage=0.6, has_scheduler_stats=True),
        2: EngineTotals(2, generation_tokens=20),  # new engine, no scheduler stats yet
    }
    summary = summarize_stats(previous, current, 2.0)
    assert summary.prompt_throughput == 100.0  # (300 - 100) / 2
    assert summary.generation_throughput == 30.0  # (20 + 20 + 20) / 2
    assert (summary.num_running, summary.num_waiting) == (5, 5)
    assert summary.kv_cache_usage_percent == pytest.approx(40.0)  # mean of 0.2 and 0.6
    assert summary.prefix_cache_hit_rate == pytest.approx(20.0)  # (10 + 30) / (100 + 100)


def test_summarize_without_activity_is_all_zero() -> None:
    assert summarize_stats({}, {}, 10.0) == StatsSummary(0.0, 0.0, 0, 0, 0.0, 0.0)
    totals = {0: EngineTotals(0, generation_tokens=5)}
    assert summarize_stats(totals, totals, 0.0) == StatsSummary(0.0, 0.0, 0, 0, 0.0, 0.0)


def generate(metrics: Metrics, tokens: int) -> None:
    tracker = metrics.tracker(engine_index=0, arrival_time=1.0, prompt_len=8, max_tokens=None)
    tracker.observe_output(5.0, 1.5, EngineCoreOutput("r", list(range(tokens)),
                                                      prefill_stats=PrefillStats(8, 8)))


class _Counter(logging.Handler):
    def __init__(self, count: int) -> None:
        super().__init__(logging.DEBUG)
        self.remaining = count
        self.done = anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.remaining -= 1
        if self.remaining <= 0:
            self.done.set()


@contextlib.contextmanager
def records_logged(name: str, count: int) -> Iterator[anyio.Event]:
    """An event set once ``count`` records went through logger ``name``."""
    handler = _Counter(count)
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield handler.done
    finally:
        logger.removeHandler(handler)


@pytest.mark.anyio
async def test_logs_info_while_busy_then_debug_when_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    metrics = Metrics()
    with records_logged(LOGGER, 3) as logged, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(
                log_stats_periodically, metrics, interval=0.05,
                logger=logging.getLogger(LOGGER)))
            generate(metrics, 10)
            metrics.observe_scheduler_stats(0, SchedulerStats(
                num_running_reqs=3, num_waiting_reqs=1, num_skipped_waiting_reqs=1,
                kv_cache_usage=0.5, prefix_cache_queries=8, prefix_cache_hits=2))
            await logged.wait()
            tg.cancel_scope.cancel()
    records = [r for r in caplog.records if r.name == LOGGER][:3]
    # Busy interval, then one more INFO (the previous interval was busy), then idle DEBUG.
    assert [r.levelno for r in records] == [logging.INFO, logging.INFO, logging.DEBUG]
    for record in records:
        assert LINE.fullmatch(record.getMessage()), record.getMessage()
    first, second = records[0].getMessage(), records[1].getMessage()
    assert "Avg prompt tput: 0.0" not in first
    assert "Avg generation tput: 0.0" not in first
    assert first.endswith("Reqs Running: 3, Waiting: 2, GPU KV cache used: 50.0%, "
                          "Prefix cache hit rate: 25.0%")
    assert second.startswith("Avg prompt tput: 0.0 toks/s, Avg generation tput: 0.0 toks/s")
    assert second.endswith("Prefix cache hit rate: 0.0%")


@pytest.mark.anyio
async def test_first_tick_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    metrics = Metrics()
    with records_logged(LOGGER, 1) as logged, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            started = anyio.current_time()
            tg.start_soon(functools.partial(
                log_stats_periodically, metrics, interval=0.2,
                logger=logging.getLogger(LOGGER)))
            await anyio.sleep(0.05)
            assert not [r for r in caplog.records if r.name == LOGGER]
            await logged.wait()
            # uvloop's clock ticks in milliseconds: 4308.651 - 4308.451 < 0.2 in floats.
            assert anyio.current_time() - started >= 0.2 - 1e-3
            tg.cancel_scope.cancel()
    record = next(r for r in caplog.records if r.name == LOGGER)
    assert record.levelno == logging.DEBUG  # nothing happened: idle
    assert record.getMessage() == StatsSummary(0.0, 0.0, 0, 0, 0.0, 0.0).message()


@pytest.mark.anyio
async def test_default_logger_and_bad_interval(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="interval"):
        await log_stats_periodically(Metrics(), interval=0)
    caplog.set_level(logging.DEBUG, logger="anyio_genout.metrics")
    metrics = Metrics()
    with records_logged("anyio_genout.metrics", 1) as logged, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(log_stats_periodically, metrics, interval=0.01))
            await logged.wait()
            tg.cancel_scope.cancel()
    assert [r for r in caplog.records if r.name == "anyio_genout.metrics"]
