"""An HTTP/1.1 server of our own for the app (``serve --http-server builtin``, the default
on trio): httptools' parser under AnyIO streams, so it runs the same on asyncio and trio.

It exists for trio, where Hypercorn (h11, in pure Python) cost about twice the CPU per
streamed token that uvicorn costs on asyncio; on asyncio it costs what uvicorn costs
(docs/performance.md, "Server"). Layers, bottom up: :mod:`.cycle` (one request's ASGI
``receive`` and ``send``, and the response's framing), :mod:`.connection` (one connection:
its reader and the parser's callbacks, its handler, and the bounds a hostile client meets),
:mod:`.server` (accepting, TLS, the graceful stop).
"""

from .server import Http1Server

__all__ = ["Http1Server"]
