"""Test hooks: what benchmarks and tests need of an engine client and applications do not.

Playing an engine in the client's own event loop (:func:`capture_input` with
:func:`deliver_output`), and looking at the client's input queue (:func:`input_queued`,
:func:`input_junk`). Nothing in the library uses them; they are kept apart from
:class:`~anyio_genout.EngineCoreClient`, every public member of which is for users.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .engine.client import EngineCoreClient, core_of

__all__ = ["capture_input", "deliver_output", "input_junk", "input_queued"]


def capture_input(engine: EngineCoreClient, sink: Callable[[list[Any]], None]) -> None:
    """From now on hand every input message of ``engine`` (``[identity, *frames]``) to
    ``sink`` instead of sending it, for a benchmark or test that plays the engine in the
    client's own event loop (with :func:`deliver_output`). Raises nothing."""
    core_of(engine).capture_input(sink)


def deliver_output(engine: EngineCoreClient, frames: list[Any]) -> None:
    """Have ``engine`` handle one output message (``frames``, as an engine sends them) as
    its reader does after receiving it: decode and dispatch (an undecodable one makes the
    client unhealthy). Raises nothing."""
    core_of(engine).deliver_output(frames)


def input_queued(engine: EngineCoreClient) -> int:
    """Messages ``engine`` queued for its engines and not yet handed to ZeroMQ."""
    return core_of(engine).input.queued


def input_junk(engine: EngineCoreClient) -> int:
    """Messages sent *to* ``engine``'s input socket after the handshake and discarded
    (engines never send there but to register again)."""
    return core_of(engine).input.junk
