"""Shared fixtures: every async test runs under asyncio and trio (AnyIO's pytest plugin)."""

from __future__ import annotations

import pytest


@pytest.fixture(
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param("trio", id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
