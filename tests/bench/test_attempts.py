"""The one "retry a cell and keep the quieter attempt" rule both measuring commands use.

Attempts are scripted (no process is run, ``settle=0`` waits for nothing): what matters is
which attempt's figures end up in the results file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from anyio_genout.bench.attempts import keep_quietest

QUIET = 0.2


def scripted(*attempts: list[dict[str, Any]]) -> tuple[Callable[[], list[dict[str, Any]]],
                                                         list[int]]:
    """An attempt function returning the given results in turn, and its call count."""
    calls = [0]

    def attempt() -> list[dict[str, Any]]:
        calls[0] += 1
        return [dict(r) for r in attempts[calls[0] - 1]]

    return attempt, calls


def test_a_busy_attempt_is_retried_and_the_quietest_is_kept() -> None:
    attempt, calls = scripted([{"tps": 1, "others_cores": 1.5}],
                              [{"tps": 2, "others_cores": 0.9}],
                              [{"tps": 3, "others_cores": 1.2}])
    [kept] = keep_quietest(attempt, retries=2, quiet=QUIET, settle=0)
    assert calls[0] == 3
    assert kept == {"tps": 2, "others_cores": 0.9, "attempt": 2}


def test_a_quiet_attempt_ends_the_retries() -> None:
    attempt, calls = scripted([{"tps": 1, "others_cores": 0.3}], [{"tps": 2}])
    [kept] = keep_quietest(attempt, retries=5, quiet=QUIET, settle=0)
    assert calls[0] == 1 and kept["attempt"] == 1


def test_a_failed_retry_never_replaces_figures_from_a_busy_attempt() -> None:
    """A failed attempt has no load figure; it used to count as the quietest one."""
    attempt, calls = scripted([{"tps": 1, "others_cores": 1.5}],
                              [{"error": "timed out after 300 s"}],
                              [{"tps": 3, "others_cores": 1.0}])
    [kept] = keep_quietest(attempt, retries=2, quiet=QUIET, settle=0)
    assert calls[0] == 3
    assert kept == {"tps": 3, "others_cores": 1.0, "attempt": 3}


def test_a_failed_cell_is_not_retried_and_a_later_success_replaces_it() -> None:
    attempt, calls = scripted([{"error": "cell exited with status 1"}])
    [kept] = keep_quietest(attempt, retries=2, quiet=QUIET, settle=0)
    assert calls[0] == 1 and "error" in kept
    # In a group (vLLM's cells share a process), a busy neighbour retries the group, and a
    # cell that failed takes the retry's figures.
    attempt, calls = scripted([{"error": "boom"}, {"tps": 1, "others_cores": 2.0}],
                              [{"tps": 5, "others_cores": 0.1}, {"tps": 6, "others_cores": 0.1}])
    kept_group = keep_quietest(attempt, retries=1, quiet=QUIET, settle=0)
    assert calls[0] == 2
    assert [r["tps"] for r in kept_group] == [5, 6]
