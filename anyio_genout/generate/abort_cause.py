"""``AbortCause``: why a request scope is being left before its terminal output.

The engine is told to abort in every case; the cause only changes what the metrics record
(``DROPPED_STREAM`` counts ``finished_reason="abort"``, ``STOP_STRING_MATCHED`` counts
``"stop"``) and the log level (info vs debug). It is read from a context variable in the task
that leaves the scope. The ``with`` block must enclose the request's ``async with`` (the
variable is read when that block exits)::

    with abort_cause(AbortCause.STOP_STRING_MATCHED):
        async with client.generate(request) as stream:
            async for out in stream:
                if matched(out):
                    break

or, to name the cause for one exit only, close the stream explicitly::

    async with client.generate(request) as stream:
        async for out in stream:
            if matched(out):
                stream.close(AbortCause.STOP_STRING_MATCHED)
                break

Like any :class:`contextvars.ContextVar`, the cause is per task and inherited: a task started
inside the ``with`` block (``tg.start_soon`` there) starts with a copy of the context, so the
scopes it leaves count with that cause too, even after the block ended; setting it in a child
never changes it for its parent. To keep a child out, start it outside the block, or enter
``abort_cause(AbortCause.DROPPED_STREAM)`` in the child.
"""

from __future__ import annotations

import contextvars
import enum
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..protocol import EngineCoreFinishReason, finish_reason_label

if TYPE_CHECKING:
    from ..engine import EngineCoreOutputStream
    from ..metrics import RequestTracker
    from .inflight import AbortedIds

__all__ = ["AbortCause", "abort_cause", "record_abort"]

logger = logging.getLogger("anyio_genout.generate")


class AbortCause(enum.Enum):
    DROPPED_STREAM = "dropped_stream"
    STOP_STRING_MATCHED = "stop_string_matched"

    @classmethod
    def current(cls) -> AbortCause:
        """The cause in effect in the calling task (``DROPPED_STREAM`` unless set)."""
        return _cause.get()

    @property
    def finished_reason(self) -> str:
        """The ``finished_reason`` metric label recorded for this cause."""
        return finish_reason_label(EngineCoreFinishReason.ABORT if self is AbortCause.DROPPED_STREAM
                                   else EngineCoreFinishReason.STOP)


_cause: contextvars.ContextVar[AbortCause] = contextvars.ContextVar(
    "anyio_genout_abort_cause", default=AbortCause.DROPPED_STREAM)


@contextmanager
def abort_cause(cause: AbortCause) -> Iterator[None]:
    """Set the abort cause for scopes left inside this ``with`` block.

    It applies to this task and to the tasks started inside the block, which inherit it
    (contextvars semantics); not to the task that started this one."""
    token = _cause.set(cause)
    try:
        yield
    finally:
        _cause.reset(token)


def record_abort(raw: EngineCoreOutputStream, tracker: RequestTracker | None,
                 aborted: AbortedIds | None, cause: AbortCause | None) -> None:
    """A live request's scope is left: record its finish under ``cause`` (else the calling
    task's :meth:`AbortCause.current`), log it, and hold its id back if the caller chose it
    (``aborted``). The caller then closes ``raw``, which sends the ABORT. Raises nothing."""
    if cause is None:
        cause = AbortCause.current()
    if tracker is not None and not tracker.finished:
        tracker.record_finished(time.time(), cause.finished_reason)
    if cause is AbortCause.DROPPED_STREAM:
        logger.info("aborting request %s: its scope was left early", raw.request_id)
    else:
        logger.debug("aborting request %s: %s", raw.request_id, cause.value)
    if aborted is not None:
        aborted.aborted(raw.request_id, raw.engine_index)
