"""vLLM's default histogram bucket boundaries (``vllm/v1/metrics/buckets.py``).

Copied verbatim so dashboards built for ``vllm serve`` work unchanged against the client's
exposition. Each tuple holds the finite upper bounds; prometheus-client appends ``+Inf``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

__all__ = [
    "HTTP_DURATION_BUCKETS",
    "HTTP_DURATION_HIGHR_BUCKETS",
    "INTER_TOKEN_LATENCY_BUCKETS",
    "ITERATION_TOKENS_BUCKETS",
    "REQUEST_LATENCY_BUCKETS",
    "REQUEST_NUM_PREEMPTIONS_BUCKETS",
    "REQUEST_PARAMS_N_BUCKETS",
    "TIME_TO_FIRST_TOKEN_BUCKETS",
    "build_1_2_5_buckets",
    "build_buckets",
]

#: ``vllm:e2e_request_latency_seconds`` and the queue/prefill/decode/inference phase times.
REQUEST_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)

#: ``vllm:time_to_first_token_seconds``.
TIME_TO_FIRST_TOKEN_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)

#: ``vllm:inter_token_latency_seconds`` and ``vllm:request_time_per_output_token_seconds``.
INTER_TOKEN_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)

#: ``vllm:request_params_n``.
REQUEST_PARAMS_N_BUCKETS: Final[tuple[float, ...]] = (1.0, 2.0, 5.0, 10.0, 20.0)

#: ``vllm:request_num_preemptions`` (the first bucket also holds never-preempted requests).
REQUEST_NUM_PREEMPTIONS_BUCKETS: Final[tuple[float, ...]] = (
    1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0,
)

#: ``vllm:iteration_tokens_total``: tokens per engine step (prompt tokens computed plus
#: tokens generated).
ITERATION_TOKENS_BUCKETS: Final[tuple[float, ...]] = (
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
)

#: ``http_request_duration_highr_seconds`` (prometheus-fastapi-instrumentator's default, as
#: ``vllm serve`` uses it).
HTTP_DURATION_HIGHR_BUCKETS: Final[tuple[float, ...]] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5,
    5.0, 7.5, 10.0, 30.0, 60.0,
)

#: ``http_request_duration_seconds`` (the instrumentator's few buckets per handler).
HTTP_DURATION_BUCKETS: Final[tuple[float, ...]] = (0.1, 0.5, 1.0)


def build_buckets(mantissas: Iterable[int], max_value: int) -> tuple[float, ...]:
    """Mantissas times increasing powers of ten, stopping at the first value above ``max_value``.

    Exactly vLLM's ``build_buckets``: ``max_value`` itself is *not* appended when it is not
    on the series (``build_1_2_5_buckets(131072)`` ends at 100000).

    Raises :class:`ValueError` if ``mantissas`` is empty or holds a value below 1.
    """
    steps = tuple(mantissas)
    if not steps or min(steps) < 1:
        raise ValueError("mantissas must be a non-empty sequence of positive integers")
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in steps:
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """``1, 2, 5, 10, 20, 50, ...`` up to ``max_value``: vLLM's token-count buckets.

    Used for ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``,
    ``vllm:request_max_num_generation_tokens``, ``vllm:request_params_max_tokens`` and
    ``vllm:request_prefill_kv_computed_tokens`` with ``max_value = max_model_len``.
    """
    return build_buckets((1, 2, 5), max_value)
