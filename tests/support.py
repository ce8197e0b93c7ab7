"""Helpers shared by every test directory (the per-directory ``support.py`` modules build on
these)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Final

import anyio
import httpx

from anyio_genout.transport import free_tcp_address

__all__ = ["mock_engine_process", "sse_lines", "sse_lines_sync", "wait_until"]

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


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The SSE stream's lines, split where SSE splits them: at LF (a CR before it dropped).
    Not ``aiter_lines``: it splits as ``str.splitlines`` does, at U+0085, U+2028 and U+2029
    too, which the JSON of a token's text carries as they are (vLLM's too), so a random
    token decoding to one cut its event's line in two (about one stream in 3,000)."""
    rest = ""
    async for text in response.aiter_text():
        *lines, rest = (rest + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if rest:
        yield rest


def sse_lines_sync(response: httpx.Response) -> Iterator[str]:
    """:func:`sse_lines` for a blocking client's response."""
    rest = ""
    for text in response.iter_text():
        *lines, rest = (rest + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if rest:
        yield rest
