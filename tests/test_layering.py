"""The protocol core stays sans-IO: no anyio, no zmq, no trio, no asyncio."""

from __future__ import annotations

import ast
from pathlib import Path

import anyio_genout.protocol

FORBIDDEN = {"anyio", "zmq", "trio", "asyncio", "socket"}


def test_protocol_core_imports_no_io_library() -> None:
    package = Path(anyio_genout.protocol.__file__).parent
    offenders = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []
