"""Reading a request's headers from its ASGI scope."""

from __future__ import annotations

from starlette.types import Scope

__all__ = ["first_header"]


def first_header(scope: Scope, name: bytes) -> bytes | None:
    """The value of the first header called ``name`` (lower case, as ASGI gives names),
    or None if there is none."""
    for header, value in scope["headers"]:
        if header == name:
            found: bytes = value
            return found
    return None
