"""The liveness check: finding an engine that is connected but hung or deaf.

Any message read from an engine proves it alive: the reader counts them per engine
(:class:`Heard`). Every half ``liveness_interval`` the check looks at the counts, and only
an engine that sent nothing since the previous look is asked a cheap utility call
(``is_sleeping``; an idle engine is so asked about every half interval). It is dead when
nothing at all arrives from it, neither the answer nor any other message, within
``liveness_timeout`` seconds of the question: an engine that goes silent is found within
``liveness_interval + liveness_timeout`` seconds, as before. So a reader that is behind
(consumers slower than the engine, a backlog of outputs queued in front of the answer)
never makes a healthy engine look dead: every output it reads meanwhile counts, and an
engine that streams is never asked at all.

The timeout counts only the time the client's event loop gave the check: it looks
``_LOOKS`` times, and a look that wakes late (a loop whose passes last longer than a look,
e.g. consumers doing blocking work on buffered outputs) counts only for its own length.
Sending the question and reading the answer take a loop pass each, so on a starved loop a
wall-clock timeout would expire before the answer could be read; counted this way it
spans at least ``_LOOKS`` passes, and a dead engine is still found, later by the loop's
lag.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from typing import Final

import anyio

from ..errors import EngineDeadError, OperationalError, UtilityCallError
from .reports import HealthReports
from .utility_calls import PendingCalls

__all__ = ["Heard", "run_liveness"]

#: Messages read from each engine so far (rank -> count), kept by the reader.
Heard = defaultdict[int, int]

#: How many times per ``liveness_timeout`` a check looks whether the engine was heard.
_LOOKS: Final = 10


async def run_liveness(live: Collection[int], heard: Heard, calls: PendingCalls,
                       reports: HealthReports, interval: float, deadline: float) -> None:
    """Every ``interval / 2`` s, check each engine up that sent nothing since the last
    look; one that stays silent ``deadline`` s after the question is reported dead
    (:meth:`~.reports.HealthReports.fail_engines`).
    Returns when the client is no longer healthy. Raises nothing of its own."""
    seen = {rank: heard[rank] for rank in live}
    while reports.healthy:
        await anyio.sleep(interval / 2)
        silent = [rank for rank in sorted(live) if heard[rank] == seen.get(rank)]
        seen = {rank: heard[rank] for rank in live}
        if not silent:
            continue
        dead: list[int] = []
        async with anyio.create_task_group() as tg:
            for rank in silent:
                tg.start_soon(_check, rank, live, heard, calls, deadline, dead)
        for rank in dead:
            if rank in live and reports.healthy:
                reports.fail_engines([rank], EngineDeadError(
                    f"engine {rank} did not answer a liveness check within {deadline:g} s, "
                    f"nor send anything else", ranks=(rank,)))
        seen = {rank: heard[rank] for rank in live}


async def _check(rank: int, live: Collection[int], heard: Heard, calls: PendingCalls,
                 deadline: float, dead: list[int]) -> None:
    """Ask ``rank`` ``is_sleeping``; append it to ``dead`` if nothing came from it within
    ``deadline`` s. Raises nothing (a client that failed or an engine found dead meanwhile
    ends the check)."""
    before = heard[rank]
    settled = anyio.Event()

    async def ask() -> None:
        try:
            await calls.call([rank], "is_sleeping", (), internal=True)
        except (UtilityCallError, OperationalError):
            pass  # an answer all the same, or the client or this engine failed meanwhile
        settled.set()

    left = deadline
    look = deadline / _LOOKS
    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
        while not settled.is_set() and heard[rank] == before and rank in live:
            if left <= 0:
                dead.append(rank)
                break
            wait = min(left, look)
            started = anyio.current_time()
            with anyio.move_on_after(wait):
                await settled.wait()
            # Time the loop kept this task waiting past its wake-up was the client's, not
            # the engine's: the question's send and the answer's read were held up as long.
            left -= min(anyio.current_time() - started, wait)
        tg.cancel_scope.cancel()
