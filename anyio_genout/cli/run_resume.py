"""``anyio-genout run --resume``: the results an earlier run already finished.

:func:`read_done` reads the output file, drops its error lines and a truncated last line (so
they run again), and returns the finished ids as :class:`DoneIds`, 17 bytes per id.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import numpy as np

from ..errors import GenoutError
from .run_input import quick_id

__all__ = ["DoneIds", "finished_id", "read_done"]

class DoneIds:
    """Request ids with a finished result: 17 bytes each (a 128-bit digest), exact lookups."""

    def __init__(self, digests: bytearray) -> None:
        self._digests = np.frombuffer(digests, dtype="S17")  # a view: no copy
        self._digests.sort()

    @staticmethod
    def digest(request_id: str) -> bytes:
        # The trailing 1 keeps numpy's fixed-width bytes from dropping a trailing NUL.
        return hashlib.blake2b(request_id.encode(), digest_size=16).digest() + b"\x01"

    def __len__(self) -> int:
        return len(self._digests)

    def __contains__(self, request_id: str) -> bool:
        key = self.digest(request_id)
        i = int(np.searchsorted(self._digests, key))
        return i < len(self._digests) and bytes(self._digests[i]) == key


def read_done(path: Path, stop: threading.Event) -> tuple[DoneIds, int] | None:
    """The finished results in ``path``; drops its error lines and a truncated last line.

    Returns the ids and how many lines were dropped (None if ``stop`` was set). A file whose
    only bad line is a truncated last one is truncated in place; otherwise the kept lines are
    copied to a new file that replaces it.
    """
    digests = bytearray()
    dropped = 0
    keep_until = 0  # end of the last kept line, while every line so far was kept
    contiguous = True
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return DoneIds(digests), 0  # nothing to resume: a first run
    except OSError as exc:
        raise GenoutError(f"cannot read {path}: {exc.strerror}") from None
    with fh:
        for number, line in enumerate(fh, 1):
            if not number & 0xFFF and stop.is_set():
                return None
            rid = finished_id(line)
            if rid is None:
                dropped += 1
                if line.endswith(b"\n"):
                    contiguous = False
                continue
            digests += DoneIds.digest(rid)
            if contiguous:
                keep_until += len(line)
    if dropped and contiguous:
        os.truncate(path, keep_until)
    elif dropped:
        temporary = path.with_name(f".{path.name}.resume")
        with open(path, "rb") as fh, open(temporary, "wb") as out:
            for line in fh:
                if finished_id(line) is not None:
                    out.write(line)
        os.replace(temporary, path)
    return DoneIds(digests), dropped


def finished_id(line: bytes) -> str | None:
    """The request id of a finished result line; None for an error or a partial line."""
    if not line.endswith(b"\n"):
        return None
    if b'"error"' not in line and line.startswith(b"{") and line.endswith(b"}\n"):
        # As run writes it: one write per line, so a complete line is a whole JSON object.
        found, rid = quick_id(line)
        if found:
            return rid
    try:
        value = json.loads(line)
    except ValueError:
        return None
    if isinstance(value, dict) and "custom_id" in value and "response" in value:
        # An OpenAI batch output line (run_batch.py): finished if it has no error.
        response, custom_id = value["response"], value["custom_id"]
        ok = value.get("error") is None and isinstance(response, dict) \
            and response.get("status_code") == 200
        return custom_id if ok and isinstance(custom_id, str) else None
    if not isinstance(value, dict) or "error" in value:
        return None
    found_id = value.get("request_id")
    return found_id if isinstance(found_id, str) else None
