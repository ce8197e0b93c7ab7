"""What one benchmark cell measures (:class:`CellSpec`) and the shape of its result.

A *cell* is one implementation (``ours``, ``floor``, ``vllm``) on one backend running one
workload at one concurrency. Specs and results travel between processes as JSON, so both are
plain data: a dataclass and a ``dict[str, Any]``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any, Final

__all__ = [
    "BACKENDS",
    "DEFAULT_CONCURRENCY",
    "IMPLEMENTATIONS",
    "WORKLOADS",
    "CellSpec",
    "Result",
    "Sample",
    "percentile",
    "summarise",
    "tokens_for",
]

Result = dict[str, Any]

#: Implementations: our client, the bare floor client, vLLM's AsyncLLM.
IMPLEMENTATIONS: Final = ("ours", "floor", "vllm")
#: Backends of our client (the floor is synchronous; vLLM runs on asyncio).
BACKENDS: Final = ("asyncio", "uvloop", "trio")
WORKLOADS: Final = ("throughput", "latency", "churn", "memory", "lateness")
DEFAULT_CONCURRENCY: Final = (1, 64, 256, 1024)


def tokens_for(concurrency: int) -> int:
    """Tokens per stream in the throughput workload (the issue's reference shapes)."""
    if concurrency <= 64:
        return 256
    if concurrency <= 256:
        return 128
    return 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class CellSpec:
    """One measurement. Rounds repeat until both ``min_rounds`` and ``min_time`` are met."""

    impl: str
    backend: str
    workload: str
    concurrency: int = 1
    #: Tokens per request (throughput, latency, memory); churn cycles through 1..4.
    tokens: int = 256
    #: Requests per round (churn) or in total (latency); in flight at once (memory).
    requests: int = 0
    prompt_len: int = 16
    min_rounds: int = 2
    max_rounds: int = 50
    min_time: float = 1.0
    engine_step_time: float = 0.0
    engine_max_num_seqs: int = 1024
    engine_log_stats: bool = False
    #: pyinstrument the measured rounds into this file (ours only; slows the run).
    profile: str | None = None

    @property
    def key(self) -> str:
        return f"{self.impl}/{self.backend}/{self.workload}/{self.concurrency}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CellSpec:
        return cls(**data)


@dataclasses.dataclass
class Sample:
    """One round: what was delivered and what it cost (seconds)."""

    wall: float
    cpu: float
    main_cpu: float
    engine_cpu: float
    engine_main_cpu: float
    #: CPU seconds that other processes on the machine used meanwhile (noise).
    others_cpu: float = 0.0
    tokens: int = 0
    requests: int = 0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


#: Busy fraction at which a side counts as saturated.
SATURATED: Final = 0.8


def summarise(spec: CellSpec, samples: Sequence[Sample], window: Sample | None = None
              ) -> Result:
    """Aggregate rounds into the figures every cell reports (totals over all rounds).

    ``window`` (first round's start to last round's end) gives the engine's busy fractions
    and the other processes' load: coarse counters are better read once over it.
    """
    wall = sum(s.wall for s in samples)
    cpu = sum(s.cpu for s in samples)
    main_cpu = sum(s.main_cpu for s in samples)
    engine_cpu = sum(s.engine_cpu for s in samples)
    engine_main = sum(s.engine_main_cpu for s in samples)
    others = sum(s.others_cpu for s in samples)
    tokens = sum(s.tokens for s in samples)
    requests = sum(s.requests for s in samples)
    main_busy = main_cpu / wall if wall else 0.0
    engine_busy = engine_main / wall if wall else 0.0
    engine_process_busy = engine_cpu / wall if wall else 0.0
    others_cores = others / wall if wall else 0.0
    if window is not None and window.wall > 0:
        engine_busy = window.engine_main_cpu / window.wall
        engine_process_busy = window.engine_cpu / window.wall
        others_cores = window.others_cpu / window.wall
    if main_busy >= SATURATED and engine_busy >= SATURATED:
        saturated = "both"
    elif main_busy >= SATURATED:
        saturated = "client"
    elif engine_busy >= SATURATED:
        saturated = "engine"
    else:
        saturated = "neither"
    result: Result = {
        "rounds": len(samples),
        "wall_s": wall,
        "delivered_tokens": tokens,
        "delivered_requests": requests,
        "client_cpu_s": cpu,
        "client_main_cpu_s": main_cpu,
        "engine_cpu_s": engine_cpu,
        "engine_main_cpu_s": engine_main,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": requests / wall if wall else 0.0,
        "cpu_us_per_token": cpu / tokens * 1e6 if tokens else None,
        "cpu_us_per_request": cpu / requests * 1e6 if requests else None,
        "busy": cpu / wall if wall else 0.0,
        "main_busy": main_busy,
        "engine_busy": engine_process_busy,
        "engine_main_busy": engine_busy,
        "saturated": saturated,
        "others_cores": others_cores,
    }
    if len(samples) > 1:
        per_round = [s.cpu / s.tokens * 1e6 for s in samples if s.tokens]
        if per_round:
            result["cpu_us_per_token_median_round"] = statistics.median(per_round)
        rates = [s.tokens / s.wall for s in samples if s.wall and s.tokens]
        if rates:
            result["tokens_per_s_median_round"] = statistics.median(rates)
    return result
