"""Helpers shared by every test directory (the per-directory ``support.py`` modules build on
these)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

import anyio

from anyio_genout.transport import free_tcp_address

__all__ = ["mock_engine_process", "wait_until"]

#: Seconds between two looks at the polled state.
_POLL_INTERVAL: Final = 0.005


async def wait_until(predicate: Callable[[], object], seconds: float = 5.0) -> None:
    """Poll ``predicate`` until it is true: for state that another task, another object or
    another process changes between awaits (a mock engine's counters, a client's flags, a
    child's output). Every wait has an end: raises :class:`TimeoutError` (failing the test)
    when the predicate is still false after ``seconds``."""
    with anyio.fail_after(seconds):
        while not predicate():  # noqa: ASYNC110 - polling other objects' state on purpose
            await anyio.sleep(_POLL_INTERVAL)


@contextmanager
def mock_engine_process(*options: str) -> Iterator[str]:
    """A mock engine in its own process (``python -m anyio_genout mock-engine`` with
    ``options``) dialing a fresh handshake address, which it yields; killed at the end."""
    address = free_tcp_address()
    child = subprocess.Popen([sys.executable, "-m", "anyio_genout", "mock-engine",
                              "--handshake-address", address, *options],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL)
    try:
        yield address
    finally:
        child.kill()
        child.wait(10)
