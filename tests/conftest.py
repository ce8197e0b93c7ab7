"""Shared fixtures: every async test runs under asyncio, asyncio+uvloop and trio."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(
        ("asyncio", {"use_uvloop": True}),
        id="uvloop",
        marks=pytest.mark.skipif(importlib.util.find_spec("uvloop") is None,
                                 reason="uvloop is not installed"),
    ),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param  # type: ignore[no-any-return]
