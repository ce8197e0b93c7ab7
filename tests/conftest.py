"""Shared fixtures: every async test runs under asyncio and trio; uvloop where the loop matters.

The ``anyio_backend`` fixture is parametrized over asyncio, asyncio+uvloop and trio. Which of
the uvloop cases run is chosen by ``--uvloop`` (default ``layers``):

* ``layers``: asyncio and trio for every async test, and uvloop too for the layers whose
  behaviour depends on the event loop's sockets, timers and callbacks (:data:`UVLOOP_LAYERS`:
  the engine client, generate, faults, transport and mock engine tests). This is ``nox -s
  tests``.
* ``all``: every async test on all three backends.
* ``only``: only the uvloop cases, of every async test in the suite (``nox -s tests-uvloop``);
  every other test is deselected.

A test that parametrizes ``anyio_backend`` itself, or a module that overrides the fixture,
runs what it names whatever the option says. A case marked ``pytest.mark.uvloop`` (a child
process run with ``--backend uvloop``) counts as a uvloop case: it runs where the fixture's
uvloop cases run.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from anyio_genout.cli.serve_http import freeze_startup_heap

_UVLOOP: tuple[str, dict[str, Any]] = ("asyncio", {"use_uvloop": True})

_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(
        _UVLOOP,
        id="uvloop",
        marks=pytest.mark.skipif(importlib.util.find_spec("uvloop") is None,
                                 reason="uvloop is not installed"),
    ),
    pytest.param(("trio", {}), id="trio"),
]

_TESTS = Path(__file__).resolve().parent

#: Test folders and files whose async tests also run on uvloop under ``--uvloop=layers``.
UVLOOP_LAYERS = tuple(_TESTS / name for name in (
    "engine", "generate", "faults", "mock", "test_transport.py",
))

_UVLOOP_CHOICES = ("layers", "all", "only")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--uvloop", choices=_UVLOOP_CHOICES, default="layers",
        help="which async tests also run on asyncio+uvloop: 'layers' (default: tests/engine, "
             "generate, faults, mock and test_transport.py), 'all', or 'only' (just the "
             "uvloop cases of every async test; nox -s tests-uvloop)")


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The test process's heap frozen as ``anyio-genout serve`` freezes its start-up heap
    (:func:`~anyio_genout.cli.serve_http.freeze_startup_heap`), then thawed: for the tests
    that bound how long the event loop may be held. By then a worker of the suite holds
    hundreds of thousands of objects from earlier tests, and a full collection of them
    (0.3-0.6 s on the 2-core machine) stalls the loop in whatever test it falls."""
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def _runs_on_uvloop(item: pytest.Item) -> bool:
    """True for the uvloop case of this conftest's ``anyio_backend`` parametrization, and for
    a case marked ``uvloop``."""
    if item.get_closest_marker("uvloop") is not None:
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("anyio_backend") is _UVLOOP


def _in_uvloop_layer(item: pytest.Item) -> bool:
    path = Path(item.path).resolve()
    return any(path == layer or layer in path.parents for layer in UVLOOP_LAYERS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mode = config.getoption("--uvloop")
    if mode == "all":
        return
    if mode == "only":
        keep = [item for item in items if _runs_on_uvloop(item)]
    else:
        keep = [item for item in items
                if not _runs_on_uvloop(item) or _in_uvloop_layer(item)]
    if len(keep) != len(items):
        kept = {id(item) for item in keep}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = keep


#: Seconds past a test's own timeout after which the watchdog below ends the whole run.
_WATCHDOG_GRACE = 60.0

#: A copy of the terminal's stderr, taken while output is not captured, for the watchdog's dump.
_WATCHDOG_FILE: list[Any] = []


def pytest_configure(config: pytest.Config) -> None:
    _WATCHDOG_FILE.append(os.fdopen(os.dup(sys.stderr.fileno()), "w"))


def pytest_unconfigure(config: pytest.Config) -> None:
    while _WATCHDOG_FILE:
        _WATCHDOG_FILE.pop().close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """A last line behind pytest-timeout: if one test (setup, call and teardown) runs past its
    timeout plus :data:`_WATCHDOG_GRACE`, dump every thread's traceback and exit the process.

    pytest-timeout's signal method raises inside the running test, which an event loop blocked
    in its selector, or a cancelled teardown that waits again, can swallow; then the run hangs
    until CI's own limit with nothing in the log. This watchdog is a C thread (faulthandler):
    nothing in the test can stop it, and the log shows where the run stuck."""
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker is not None and marker.args else float(
        item.config.getini("timeout") or 60)
    faulthandler.dump_traceback_later(limit + _WATCHDOG_GRACE, exit=True,
                                      file=_WATCHDOG_FILE[0])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
