"""Stop strings, with vLLM 0.32's rules (sans-IO).

* A match must end in the text being checked (the new characters); it may start up to
  ``len(stop) - 1`` characters before them, so a stop string split across tokens or steps is
  found exactly once.
* When several stop strings match, the one that **completes earliest** in the text wins; a tie
  goes to the one listed first. This holds also when one step brings several tokens, so the
  result is the same as feeding the tokens one at a time.
* The text is cut at the start of the match, or at its end with
  ``include_stop_str_in_output``.
* While streaming, the last ``max(len(stop)) - 1`` characters are held back (0 with
  ``include_stop_str_in_output`` or without stop strings), so a stop string is never
  half-sent; the held text goes out when the request finishes.

Example: stops ``("END", "ND!")`` and text ``"the END!"`` arriving as ``"the EN"``, ``"D!"``:
the first step emits ``"the "`` (``"EN"`` held back), the second finds ``"END"`` (it completes
before ``"ND!"``) and the text ends as ``"the "``, or ``"the END"`` when included.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ..errors import InvalidRequestError

__all__ = ["StopMatch", "StopStrings"]


@attrs.frozen
class StopMatch:
    """One stop string found: ``text[start:end] == stop``."""

    stop: str
    start: int
    end: int


def _stops_converter(stop: Sequence[str] | str) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop)


@attrs.frozen
class StopStrings:
    """A request's stop strings (a ``str`` is taken as one stop string).

    Raises InvalidRequestError("stop", ...) for an empty stop string or one that is not a str.
    """

    stops: tuple[str, ...] = attrs.field(converter=_stops_converter, default=())
    include_in_output: bool = False

    def __attrs_post_init__(self) -> None:
        for stop in self.stops:
            if not isinstance(stop, str):
                raise InvalidRequestError("stop", f"must be strings, got {type(stop).__name__}")
            if not stop:
                raise InvalidRequestError("stop", "cannot contain an empty string")

    @property
    def longest(self) -> int:
        """The length of the longest stop string (0 without any)."""
        return max(map(len, self.stops), default=0)

    @property
    def hold_back(self) -> int:
        """Characters kept back while streaming: ``longest - 1``, or 0 (none, or included)."""
        if not self.stops or self.include_in_output:
            return 0
        return self.longest - 1

    def search(self, text: str, begin: int) -> StopMatch | None:
        """The winning match that ends after ``text[:begin]`` (at least one char at ``begin``
        or later), or ``None``. Earliest end wins; ties go by list order."""
        if begin >= len(text):
            return None
        best: StopMatch | None = None
        for stop in self.stops:
            start = text.find(stop, max(0, begin + 1 - len(stop)))
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or end < best.end:
                best = StopMatch(stop, start, end)
        return best

    def cut(self, match: StopMatch) -> int:
        """Where the text ends after ``match``: its start, or its end when included."""
        return match.end if self.include_in_output else match.start
