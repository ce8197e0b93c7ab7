"""Hypothesis settings shared by the protocol tests.

By default every property test is derandomized (the same examples on every run, no example
database) and sized to keep the whole suite well under a minute. For a longer, randomized
fuzzing session set ``ANYIO_GENOUT_FUZZ_SCALE`` (e.g. ``50``): example counts are multiplied
by it and the seed is random.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = float(os.environ.get("ANYIO_GENOUT_FUZZ_SCALE", "1"))


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max(1, int(max_examples * SCALE)),
        deadline=None,
        derandomize=SCALE == 1,
        database=None,  # no .hypothesis directory
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
