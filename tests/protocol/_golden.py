"""Access to the golden frames a real vLLM 0.32.0 engine produced (tests/data/vllm-wire).

Each message ``<name>`` is stored as ``<name>.frameN.bin`` (exact bytes of ZMQ frame N) plus a
``<name>.hex`` dump; ``run-results.json`` in every folder holds the capturing front end's
decoded results and a log of every saved message (with the schema-less msgpack decode of most
engine outputs). Expectations in the tests come from these manifests, not from our decoder.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import msgpack

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm-wire"
MAIN = "."
VARIANTS = (
    "variant-disable-log-stats-oov",
    "variant-duplicate-request-id",
    "variant-eos-stop-logprobs",
    "variant-sigterm-inflight-enginecore",
)
FOLDERS = (MAIN, *VARIANTS)
_FRAME = re.compile(r"\.frame(\d+)\.bin$")


@dataclass(frozen=True)
class Message:
    """One saved message: ``folder/name`` with its frames in order."""

    folder: str
    name: str

    @property
    def id(self) -> str:
        return self.name if self.folder == MAIN else f"{self.folder}/{self.name}"

    @property
    def frames(self) -> list[bytes]:
        return load_frames(self.folder, self.name)

    @property
    def log(self) -> str:
        """The manifest's note about this message (run-results.json log)."""
        return log_notes(self.folder)[self.name]

    @property
    def plain(self) -> Any:
        """The manifest's schema-less decode of an engine output (``decoded(plain)=...``)."""
        note = self.log
        prefix = "decoded(plain)="
        if not note.startswith(prefix):
            raise LookupError(f"{self.id}: the manifest has no plain decode")
        return ast.literal_eval(note[len(prefix):])

    def __str__(self) -> str:
        return self.id


@cache
def load_frames(folder: str, name: str) -> list[bytes]:
    paths = sorted(
        (DATA / folder).glob(f"{name}.frame*.bin"),
        key=lambda p: int(_FRAME.search(p.name).group(1)),  # type: ignore[union-attr]
    )
    if not paths:
        raise FileNotFoundError(f"no frames for {folder}/{name}")
    return [p.read_bytes() for p in paths]


@cache
def run_results(folder: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / folder / "run-results.json").read_text())
    return data


@cache
def log_notes(folder: str) -> dict[str, str]:
    return {entry[1]: entry[3] for entry in run_results(folder)["log"]}


def log_order(folder: str) -> list[str]:
    """Names of the saved messages in the order they were captured."""
    return [entry[1] for entry in run_results(folder)["log"]]


def messages(prefix: str = "", folders: tuple[str, ...] = FOLDERS) -> list[Message]:
    """Every saved message whose name starts with ``prefix``, in capture order."""
    found = []
    for folder in folders:
        names = {p.name[: -len(".hex")] for p in (DATA / folder).glob("*.hex")}
        for name in log_order(folder):
            if name in names and name.startswith(prefix):
                found.append(Message(folder, name))
    return found


def message(folder: str, name: str) -> Message:
    for m in messages("", (folder,)):
        if m.name == name:
            return m
    raise LookupError(f"no message {folder}/{name}")


def find(folder: str, prefix: str) -> Message:
    """The single message in ``folder`` whose name starts with ``prefix``."""
    found = messages(prefix, (folder,))
    if len(found) != 1:
        raise LookupError(f"{len(found)} messages match {folder}/{prefix}*")
    return found[0]


def plain_unpack(data: bytes) -> Any:
    """Schema-less msgpack decode, keeping extension types as :class:`msgpack.ExtType`."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False,
                           ext_hook=lambda code, raw: msgpack.ExtType(code, raw))


def typed(value: Any) -> Any:
    """``value`` with every scalar tagged by its type, so 0 != 0.0 != False when compared."""
    if isinstance(value, dict):
        return ("map", [(typed(k), typed(v)) for k, v in value.items()])
    if isinstance(value, list | tuple):
        return ("array", [typed(v) for v in value])
    return (type(value).__name__, value)
