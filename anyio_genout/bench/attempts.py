"""Running cells in fresh processes, again while the machine was busy; the quietest attempt.

A shared machine's other tenants are the main source of noise in wall-clock figures, so a
command waits until the machine is quiet before an attempt (up to ``settle`` seconds) and
runs a cell again while other processes used more than twice ``quiet`` cores during it,
keeping the quietest attempt (:func:`keep_quietest`, the one rule both measuring commands
use). A cell runs in ``python -m anyio_genout.bench.cell`` (:func:`run_cell`); vLLM's cells run
a group at a time in ``python -m anyio_genout.bench.vllm_ref`` (:func:`run_vllm_group`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from .spec import CellSpec, Result

__all__ = ["keep_quietest", "noise", "run_cell", "run_vllm_group"]


def noise(result: Result) -> float:
    """The cores other processes used while the cell ran (0 when not measured)."""
    others = result.get("others_cores")
    return float(others) if isinstance(others, int | float) else 0.0


def _better(old: Result, new: Result) -> Result:
    """Of two attempts at one cell: one without an error, else the quieter (ties: old)."""
    if ("error" in old) != ("error" in new):
        return old if "error" in new else new
    return new if noise(new) < noise(old) else old


def keep_quietest(attempt: Callable[[], list[Result]], *, retries: int, quiet: float,
                  settle: float) -> list[Result]:
    """Run ``attempt`` (its results are cells, in a fixed order) up to ``1 + retries`` times.

    Before each attempt, waits up to ``settle`` seconds (none if 0) until other processes
    use under ``quiet`` cores, and records that load as ``others_cores_before``; each result
    records its ``attempt`` (from 1). Cell by cell, a result without an error beats one with,
    then the quieter one is kept. Stops once every kept cell failed or was quiet (other
    processes used at most twice ``quiet`` cores during it): a failed cell is not retried.

    Raises :class:`ValueError` if two attempts return different numbers of cells.
    """
    kept: list[Result] = []
    for number in range(1, 2 + max(retries, 0)):
        before = None
        if settle:
            from .measure import wait_until_quiet  # psutil: checked before a command starts

            before = wait_until_quiet(quiet, settle)
        found = attempt()
        for result in found:
            result["attempt"] = number
            if before is not None:
                result["others_cores_before"] = round(before, 3)
        kept = found if number == 1 else [
            _better(old, new) for old, new in zip(kept, found, strict=True)]
        if all("error" in r or noise(r) <= 2 * quiet for r in kept):
            break
    return kept


def run_cell(spec: CellSpec, timeout: float) -> list[Result]:
    """Run one cell in a fresh interpreter: its result, alone in a list (an ``error`` key
    if it failed or ran over ``timeout`` seconds); its output is shown only if it fails."""
    with tempfile.TemporaryDirectory(prefix="anyio-genout-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "anyio_genout.bench.cell", json.dumps(spec.to_json()),
               str(out)]
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=timeout, text=True)
        except subprocess.TimeoutExpired:
            return [{**spec.to_json(), "error": f"timed out after {timeout:g} s"}]
        if out.exists():
            result: Result = json.loads(out.read_text())
        else:
            result = {**spec.to_json(), "error": f"cell exited with status {proc.returncode}"}
        if "error" in result:
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        return [result]


def run_vllm_group(specs: Sequence[CellSpec], model: str, loop: str, timeout: float
                   ) -> list[Result]:
    """Run cells sharing one engine shape in one AsyncLLM process (its handshake is
    one-shot): a result per cell, in order, each with an ``error`` key if it failed."""
    with tempfile.TemporaryDirectory(prefix="anyio-genout-bench-vllm-") as tmp:
        out = Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "anyio_genout.bench.vllm_ref",
               json.dumps([s.to_json() for s in specs]), str(out), "--model", model,
               "--loop", loop]
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=timeout + 120, text=True)
        except subprocess.TimeoutExpired:
            return [{**s.to_json(), "loop": loop, "error": "timed out"} for s in specs]
        if not out.exists():
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-6000:])
            return [{**s.to_json(), "loop": loop,
                     "error": f"AsyncLLM process exited with status {proc.returncode}"}
                    for s in specs]
        results: list[Result] = json.loads(out.read_text())
        if any("error" in r for r in results):
            sys.stderr.write(proc.stderr[-6000:])
        return results
