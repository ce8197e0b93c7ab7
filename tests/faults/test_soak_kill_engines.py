"""Three seconds of ``tools/soak.py --kill-engines`` on every backend: engines killed and
restarted at random under load, migration on; nothing lost, nothing leaked (the 60 s runs
are ``nox -s soak -- --kill-engines``, figures in docs/reliability.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from soak_engines import kill_engines_soak

pytestmark = pytest.mark.anyio


async def test_engines_killed_and_restarted_under_load_lose_nothing() -> None:
    args = argparse.Namespace(duration=3.0, engines=3, workers=16, migration_limit=3,
                              seed=7, backend="test")
    lines: list[str] = []
    problems = await kill_engines_soak(args, lines.append, lambda: 0)
    assert problems == [], "\n".join(lines)
    kills = next(line for line in lines if line.startswith("kills: "))
    assert not kills.startswith("kills: 0 "), lines  # it did kill
