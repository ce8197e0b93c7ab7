"""One cell in a fresh process: ``python -m anyio_genout.bench.cell SPEC_JSON RESULT_PATH``.

Runs the cell's implementation with its own engine process and writes the result (the spec's
fields plus the figures, or an ``error``) as JSON to ``RESULT_PATH``.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Sequence

from .spec import CellSpec, Result

__all__ = ["main", "run_cell"]


def run_cell(spec: CellSpec) -> Result:
    if spec.impl == "ours":
        from . import ours

        figures = ours.run(spec)
    elif spec.impl == "floor":
        from . import floor

        figures = floor.run(spec)
    else:
        raise ValueError(f"cell: implementation {spec.impl!r} does not run in a cell "
                         f"(vLLM runs through `anyio-genout bench vllm`)")
    return {**spec.to_json(), **figures}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m anyio_genout.bench.cell SPEC_JSON RESULT_PATH", file=sys.stderr)
        return 2
    spec = CellSpec.from_json(json.loads(args[0]))
    try:
        result = run_cell(spec)
        status = 0
    except BaseException as exc:
        traceback.print_exc()
        result = {**spec.to_json(), "error": f"{type(exc).__name__}: {exc}"}
        status = 1
    with open(args[1], "w") as handle:
        json.dump(result, handle, indent=1, default=str)
    return status


if __name__ == "__main__":
    sys.exit(main())
