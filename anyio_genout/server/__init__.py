"""The server layer: an OpenAI-compatible HTTP API over a :class:`~anyio_genout.TextClient`.

:func:`create_app` builds the ASGI application (FastAPI: pydantic request models, an
OpenAPI schema); ``anyio-genout serve`` serves it with Hypercorn on trio or asyncio. An
HTTP disconnect cancels the request's scope, which aborts the engine request once. Needs
the ``server`` extra (``pip install 'anyio-genout[server]'``). See docs/server.md.
"""

from .app import create_app

__all__ = ["create_app"]
