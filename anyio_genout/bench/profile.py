"""Summarise profiles of a cell: top functions by self and total time, and time by area.

Two sources:

* ``anyio-genout bench --profile DIR``: the measured rounds of each selected cell of ours run
  under pyinstrument (which slows them; the profiled figures count for no target); the call
  tree goes to a text file, the summary into the JSON and onto the console.
* py-spy's collapsed stacks (``py-spy record --nonblocking -f raw``, which barely slows the
  process), summarised by ``anyio-genout bench profile STACKS.txt``; see
  docs/performance.md for the command line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["area_of", "summarise_collapsed", "summarise_frames", "write_profile"]

#: Path fragments that name an area of the code, checked in order.
_AREAS: tuple[tuple[str, str], ...] = (
    ("anyio_genout/protocol", "anyio_genout.protocol (decode)"),
    ("anyio_genout/engine", "anyio_genout.engine (reader, registry)"),
    ("anyio_genout/generate", "anyio_genout.generate (streams, outputs)"),
    ("anyio_genout/metrics", "anyio_genout.metrics"),
    ("anyio_genout/transport", "anyio_genout.transport (zmq shell)"),
    ("anyio_genout/bench", "benchmark harness"),
    ("anyio/", "anyio"),
    ("trio/", "trio"),
    ("uvloop", "uvloop"),
    ("asyncio/", "asyncio"),
    ("zmq/", "pyzmq"),
    ("msgpack", "msgpack"),
    ("prometheus_client", "prometheus_client"),
    ("attr/", "attrs"),
)


def classify_path(path: str | None, areas: Sequence[tuple[str, str]], builtins: str) -> str:
    """The name of the first of ``areas`` (path fragment, name) whose fragment is in
    ``path``; ``builtins`` for no path or a generated one (``<...>``); else "other"."""
    if not path or path.startswith("<"):
        return builtins
    path = path.replace("\\", "/")
    for fragment, name in areas:
        if fragment in path:
            return name
    return "other"


def area_of(path: str | None) -> str:
    return classify_path(path, _AREAS,
                         "builtins and generated code (time.time, len, attrs __init__, ...)")


def _walk(frame: Any, ancestors: frozenset[str]) -> Iterator[tuple[Any, bool]]:
    """(frame, counts for total time) pairs: a recursive frame counts once."""
    identifier = frame.identifier
    yield frame, identifier not in ancestors
    below = ancestors | {identifier}
    for child in frame.children:
        yield from _walk(child, below)


def _name(frame: Any) -> str:
    where = frame.file_path_short or frame.file_path or "?"
    return f"{frame.function} ({where}:{frame.line_no})"


def summarise_frames(root: Any, top: int = 15) -> dict[str, Any]:
    """Self time and total time per function, self time per area; percents of the total."""
    total = root.time or 1e-12
    self_time: dict[str, float] = {}
    cumulative: dict[str, float] = {}
    areas: dict[str, float] = {}
    for frame, first in _walk(root, frozenset()):
        if frame.is_synthetic:  # "[self]"/"[await]" leaves: counted in their parent
            continue
        name = _name(frame)
        own = frame.total_self_time
        self_time[name] = self_time.get(name, 0.0) + own
        area = area_of(frame.file_path)
        areas[area] = areas.get(area, 0.0) + own
        if first:
            cumulative[name] = cumulative.get(name, 0.0) + frame.time

    def ranked(table: dict[str, float]) -> list[list[Any]]:
        rows = sorted(table.items(), key=lambda item: item[1], reverse=True)[:top]
        return [[name, round(seconds, 4), round(100.0 * seconds / total, 1)]
                for name, seconds in rows]

    return {
        "sampled_s": round(total, 4),
        "top_self": ranked(self_time),
        "top_total": ranked(cumulative),
        "by_area": ranked(areas),
    }


def write_profile(profiler: Any, path: str) -> dict[str, Any]:
    """Write the call tree and the summary to ``path``; return the summary."""
    session = profiler.last_session
    root = session.root_frame() if session is not None else None
    if root is None:
        return {"error": "no samples"}
    summary = summarise_frames(root)
    lines = [f"sampled {summary['sampled_s']} s", "", "self time by area:"]
    lines += [f"  {pct:5.1f}%  {name}" for name, _s, pct in summary["by_area"]]
    lines += ["", "top functions by self time:"]
    lines += [f"  {pct:5.1f}%  {name}" for name, _s, pct in summary["top_self"]]
    lines += ["", "top functions by total time:"]
    lines += [f"  {pct:5.1f}%  {name}" for name, _s, pct in summary["top_total"]]
    lines += ["", "call tree:", profiler.output_text(unicode=False, color=False,
                                                       show_all=False)]
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(lines))
    summary["file"] = str(target)
    return summary


_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _parse_frame(text: str) -> tuple[str, str]:
    """(display name without the line, file) of one py-spy frame ``func (file:line)``."""
    match = _FRAME.match(text.strip())
    if match is None:
        return text.strip(), ""
    return f"{match['function']} ({match['file']})", match["file"]


def summarise_collapsed(lines: Sequence[str], *, within: str | None = None, top: int = 20
                        ) -> dict[str, Any]:
    """Summarise py-spy ``raw`` (collapsed) stacks: ``frame;frame;... count`` per line.

    Only stacks through a frame containing ``within`` count (e.g. the event loop's
    ``run_forever``: the measured client, not start-up). Functions are merged across lines.
    """
    total = 0
    self_time: dict[str, int] = {}
    cumulative: dict[str, int] = {}
    areas: dict[str, int] = {}
    for line in lines:
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        if within is not None and within not in stack:
            continue
        count = int(count_text)
        total += count
        frames = [_parse_frame(f) for f in stack.split(";")]
        name, path = frames[-1]
        self_time[name] = self_time.get(name, 0) + count
        area = area_of(path if path and not path.startswith("<") else None)
        areas[area] = areas.get(area, 0) + count
        for seen in {n for n, _p in frames}:
            cumulative[seen] = cumulative.get(seen, 0) + count

    def ranked(table: dict[str, int]) -> list[list[Any]]:
        rows = sorted(table.items(), key=lambda item: item[1], reverse=True)[:top]
        return [[name, samples, round(100.0 * samples / (total or 1), 1)]
                for name, samples in rows]

    return {"samples": total, "top_self": ranked(self_time), "top_total": ranked(cumulative),
            "by_area": ranked(areas)}
