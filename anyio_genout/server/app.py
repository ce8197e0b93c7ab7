"""``create_app``: the OpenAI-compatible ASGI application over a :class:`TextClient`."""

from __future__ import annotations

import functools
import importlib.metadata
import time
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..engine.registry import why_down
from ..errors import EngineDeadError, GenoutError
from ..text.client import TextClient
from .auth import ApiKeyScope, Authentication, check_api_key
from .errors import ApiError, error_for, install_handlers
from .fingerprint import FingerprintMode, check_fingerprint_options, system_fingerprint
from .headers import first_header
from .http_metrics import HttpMetrics, client_http_series
from .json_route import JsonRoute
from .limits import Limits, tolerant_send
from .models import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .response import BODY_SEND, TextResponse
from .serving import Serving
from .tokenize import tokenize_request
from .tools import ToolServing

__all__ = ["create_app"]


class _App(FastAPI):
    """FastAPI that hands its streamed responses the server's own ``send`` for their
    body (:data:`.response.BODY_SEND`): every layer between (Starlette's error and
    exception wrappers, the route's, the metrics, limits, key and CORS middlewares) acts on
    a response's start message only, and each layer's wrapper cost one more coroutine call
    per SSE event (six of them: 3 % of the server's py-spy samples at 64 streams on
    uvicorn). On trio it keeps :func:`.limits.tolerant_send`."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[BODY_SEND] = tolerant_send(send)
        await super().__call__(scope, receive, send)

try:
    _VERSION = importlib.metadata.version("anyio-genout")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a bare source tree
    _VERSION = "unknown"

#: The defaults of create_app's limits (and of ``anyio-genout serve``'s options).
MAX_N = 16
MAX_BODY_SIZE = 1 << 20
BODY_TIMEOUT = 30.0


def create_app(text_client: TextClient, *, model_name: str, api_key: str | None = None,
               api_key_scope: ApiKeyScope = "v1",
               max_n: int = MAX_N, max_body_size: int = MAX_BODY_SIZE,
               max_concurrent_requests: int | None = None,
               body_timeout: float | None = BODY_TIMEOUT,
               trust_request_chat_template: bool = False,
               enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None,
               fingerprint_mode: FingerprintMode = "full",
               fingerprint_value: str | None = None, stream_interval: int = 1,
               sampling_defaults: Mapping[str, Any] | None = None) -> FastAPI:
    """The OpenAI-compatible server's ASGI application (FastAPI) over ``text_client``.

    ``model_name`` is the one model ``/v1/models`` lists and requests may name (another
    one is 404). With ``api_key``, the routes of ``api_key_scope`` need
    ``Authorization: Bearer <api_key>``, checked before any of the body is read (401
    otherwise; compared in constant time): ``"v1"`` (vLLM's) the ``/v1`` routes,
    ``"all"`` every route but ``/health``, ``/ping`` and ``/version``.
    Limits: ``n`` at most ``max_n`` (400), a request body at most ``max_body_size`` bytes
    (413), ``max_tokens`` at most the engines' ``max_model_len`` (400), and with
    ``max_concurrent_requests`` at most that many completions and chat completions at once
    (429 beyond), and a body must arrive whole within ``body_timeout`` seconds (408). A
    request's own chat template (``chat_template``, or in ``chat_template_kwargs``) is a 400
    naming it unless ``trust_request_chat_template`` (vLLM's
    ``--trust-request-chat-template``; CVE-2025-61620). Templates render, and long prompts
    encode, in worker threads, a prompt that cannot fit the context being refused first.
    Chat outputs are read with ``reasoning_parser`` and, for ``tool_choice="auto"`` (which
    needs ``enable_auto_tool_choice``), ``tool_call_parser`` (vLLM's names, see
    :mod:`anyio_genout.parsers`); ``tool_choice="required"`` and a named function are
    held to vLLM's JSON schema and need neither.
    Responses carry a ``system_fingerprint`` as vLLM's ``--fingerprint-mode`` and
    ``--fingerprint-value`` choose it (:mod:`.fingerprint`; ``"none"``: none).
    A streamed chunk holds at least ``stream_interval`` tokens (or a request's own
    ``stream_interval`` if larger; the first tokens and the end at once), as vLLM's
    ``--stream-interval``. ``sampling_defaults`` (see :mod:`.generation_defaults`, e.g.
    ``generation_defaults("auto", tokenizer.model_dir)``, what ``serve`` passes) fill the
    sampling fields a request leaves unset, as vLLM's ``--generation-config`` does.
    Serve it with any ASGI server; ``anyio-genout serve`` uses uvicorn (asyncio) or
    Hypercorn (trio).
    See docs/server.md.

    Raises:
        InvalidRequestError: an unknown parser name, or ``enable_auto_tool_choice``
            without ``tool_call_parser``; an unknown ``fingerprint_mode``, or
            ``fingerprint_value`` without mode ``"custom"`` (or that mode without it).
        ValueError: ``stream_interval`` below 1.
    """

    check_api_key(api_key, api_key_scope)
    check_fingerprint_options(fingerprint_mode, fingerprint_value)
    tool_serving = ToolServing.from_names(tool_call_parser, reasoning_parser,
                                          enable_auto_tool_choice=enable_auto_tool_choice)

    if stream_interval < 1:
        raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
    serving = Serving(text_client=text_client, model_name=model_name, max_n=max_n,
                      stream_interval=stream_interval,
                      sampling_defaults=dict(sampling_defaults or {}),
                      trust_request_chat_template=trust_request_chat_template,
                      tool_serving=tool_serving,
                      fingerprint=functools.cache(functools.partial(  # once, when first used
                          system_fingerprint, text_client, model_name=model_name,
                          mode=fingerprint_mode, value=fingerprint_value)))
    check_model = serving.check_model
    client = text_client.client
    tokenizer = text_client.tokenizer
    app = _App(title="anyio-genout", docs_url=None, redoc_url=None)
    install_handlers(app)
    app.add_middleware(Limits, max_body_size=max_body_size,
                       max_concurrent_requests=max_concurrent_requests,
                       body_timeout=body_timeout,
                       limited_paths=frozenset({"/v1/completions", "/v1/chat/completions"}))
    # vllm serve's HTTP families; inside the key check (a 401 is not counted, as there)
    app.add_middleware(HttpMetrics, series=client_http_series(text_client.client))
    if api_key is not None:  # outermost: the key is checked before Limits reads a body
        app.add_middleware(Authentication, api_key=api_key, api_key_scope=api_key_scope,
                           body_timeout=body_timeout)
    api = APIRouter()

    @app.get("/health")
    async def health() -> Response:
        # 503 while the server drains (``app.state.lifecycle``, set by ``anyio-genout
        # serve``), while the client is unhealthy, and while no engine is up.
        lifecycle = getattr(app.state, "lifecycle", None)
        if lifecycle is not None and lifecycle.draining:
            raise ApiError(503, "the server is shutting down (draining its open requests)")
        engine = client.engine
        error = engine.health_error
        if error is None and not engine.live_engines:  # last_engine_death="wait"
            error = EngineDeadError(f"every engine is down ({why_down(engine.engine_health)})")
        if error is not None:
            raise error_for(error)
        return Response(status_code=200)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": int(time.time()),
                "owned_by": "anyio-genout", "root": model_name, "parent": None,
                "max_model_len": client.engine.max_model_len, "permission": []}

    @app.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
    async def ping() -> Response:  # vLLM's (SageMaker's) name for /health
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:  # vLLM's gives its own version; this, ours
        return {"version": _VERSION}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:  # OpenAI's; vLLM 0.32 has none
        check_model(model_id)
        return model_card()

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(client.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    def generation(body: CompletionRequest | ChatCompletionRequest, scope: Scope) -> Response:
        check_model(body.model)
        _header_request_id(body, scope)
        return TextResponse(text_client, serving.plan(body))

    # FastAPI's routes answer what JsonRoute does not take (and give the OpenAPI schema)
    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return generation(body, raw.scope)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return generation(body, raw.scope)

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        check_model(body.model)
        request = tokenize_request(body, trust_request_chat_template=trust_request_chat_template)
        try:  # rendered and encoded off the event loop; too long for the context: refused
            _, ids = await text_client.encode(request)
        except GenoutError as exc:
            raise error_for(exc) from None
        result: dict[str, Any] = {"count": len(ids), "max_model_len":
                                  client.engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            result["token_strs"] = tokenizer.token_strings(ids)
        return JSONResponse(result)

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        check_model(body.model)
        try:  # the one vocabulary check (protocol.validation), as for prompts; long: off
            # the event loop
            text = await text_client.decode(body.tokens, skip_special_tokens=False,
                                            field="tokens")
        except GenoutError as exc:
            raise error_for(exc) from None
        return JSONResponse({"prompt": text})

    app.include_router(api)
    app.router.routes[:0] = [JsonRoute("/v1/completions", CompletionRequest, generation),
                             JsonRoute("/v1/chat/completions", ChatCompletionRequest,
                                       generation)]
    return app


def _header_request_id(body: CompletionRequest | ChatCompletionRequest, scope: Scope) -> None:
    """An ``X-Request-Id`` header (the first) names the request in place of its
    ``request_id`` field, as vLLM's ``_base_request_id`` has it (the response's id is
    ``cmpl-`` or ``chatcmpl-`` and this)."""
    value = first_header(scope, b"x-request-id")
    if value is not None:
        body.request_id = value.decode("latin-1")  # no lone surrogates
