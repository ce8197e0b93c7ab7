"""The event loops the command line runs on, and the one line a missing extra gets.

``--backend`` takes ``asyncio``, ``uvloop`` (asyncio on uvloop) or ``trio``. uvloop and trio
come with extras (``pip install 'anyio-genout[uvloop]'``, ``[trio]``), so a plain install
has neither; a command checks its backend with :func:`require_backend` before it starts
the loop, and a missing library is one line naming the extra (exit status 2), not a
traceback from deep inside ``anyio.run``. :func:`extra_message` words the same line for any
other extra (``anyio-genout bench`` needs the ``bench`` extra).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Final

__all__ = ["BACKENDS", "anyio_run_arguments", "extra_message", "importable",
           "missing_backend", "require_backend"]

#: The values of ``--backend``, in the order the help lists them.
BACKENDS: Final = ("asyncio", "uvloop", "trio")

#: backend -> (the module it imports, the extra that installs it)
_NEEDS: Final = {"uvloop": ("uvloop", "uvloop"), "trio": ("trio", "trio")}


def extra_message(what: str, extra: str) -> str:
    """``"<what> needs the '<extra>' extra: pip install 'anyio-genout[<extra>]'"``."""
    return f"{what} needs the '{extra}' extra: pip install 'anyio-genout[{extra}]'"


def importable(module: str) -> bool:
    """True if ``module`` imports (it is then imported)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def missing_backend(command: str, backend: str, option: str = "--backend") -> str | None:
    """The one-line message for ``<command> <option> <backend>`` when the backend's library
    is not installed, or None when it is (or needs none)."""
    need = _NEEDS.get(backend)
    if need is None or importable(need[0]):
        return None
    return extra_message(f"{command} {option} {backend}", need[1])


def require_backend(command: str, backend: str) -> None:
    """Print :func:`missing_backend`'s line to stderr and exit with status 2 if the
    backend's library is missing; return otherwise (``command`` is what the line names,
    e.g. ``"anyio-genout generate"``).

    Raises :class:`SystemExit` (status 2), as argparse does for a bad argument.
    """
    message = missing_backend(command, backend)
    if message is not None:
        print(message, file=sys.stderr)
        raise SystemExit(2)


def anyio_run_arguments(backend: str) -> tuple[str, dict[str, Any]]:
    """``anyio.run``'s ``backend`` and ``backend_options`` for a ``--backend`` value."""
    if backend == "uvloop":
        return "asyncio", {"use_uvloop": True}
    return backend, {}
