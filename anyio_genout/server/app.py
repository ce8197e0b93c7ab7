"""``create_app``: the OpenAI-compatible ASGI application over a :class:`TextClient`."""

from __future__ import annotations

import hmac
import os
import time
from typing import Any

import attrs
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from ..errors import GenoutError
from ..protocol import SamplingParams, StructuredOutputsParams
from ..text.client import TextClient
from ..text.request import TextRequest
from .errors import ApiError, error_for, install_handlers
from .formats import ChatFormat, CompletionFormat
from .limits import Limits
from .models import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .response import TextResponse

__all__ = ["create_app"]

#: The sampling fields passed on as they are when the request sets them.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
             "frequency_penalty", "repetition_penalty")


def _check_unicode(value: object, field: str) -> None:
    """400 naming the place of a lone surrogate (valid JSON escapes, not text a tokenizer
    or template takes) in ``value``'s strings."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"invalid request: {field}: is not valid Unicode text: lone "
                           f"surrogate at index {exc.start}", field) from None
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{field}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, field)
            _check_unicode(item, f"{field}.{key}")


def _structured(body: CompletionRequest | ChatCompletionRequest
                ) -> StructuredOutputsParams | None:
    """``response_format`` or vLLM's ``structured_outputs`` as the engine's constraint (its
    checks run on entering the request and name ``structured_outputs.<kind>``)."""
    form, extension = body.response_format, body.structured_outputs
    if form is not None and form.type != "text" and extension is not None:
        raise ApiError(400, "invalid request: structured_outputs: give either "
                       "response_format or structured_outputs, not both", "structured_outputs")
    if extension is not None:
        try:
            return StructuredOutputsParams(**extension)
        except TypeError as exc:
            raise ApiError(400, f"invalid request: structured_outputs: {exc}",
                           "structured_outputs") from None
        except GenoutError as exc:
            raise error_for(exc) from None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if form.json_schema is None or form.json_schema.json_schema is None:
        raise ApiError(400, "invalid request: response_format.json_schema: needs a schema "
                       "with type json_schema", "response_format.json_schema")
    return StructuredOutputsParams(json=form.json_schema.json_schema)


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
              logprobs: int | None) -> SamplingParams:
    given = {name: getattr(body, name) for name in _SAMPLING if getattr(body, name) is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, min_tokens=body.min_tokens,
                              ignore_eos=body.ignore_eos, logprobs=logprobs,
                              stop_token_ids=tuple(body.stop_token_ids or ()),
                              structured_outputs=_structured(body), **given)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"invalid sampling parameters: {exc}") from None


def _choices(request: TextRequest, n: int) -> list[TextRequest]:
    """The ``n`` child requests of one with ``n`` choices, as vLLM makes them: ids
    ``"{i}_{id}"`` and seeds ``seed + i`` when a seed is given."""
    if n == 1:
        return [request]
    params = request.sampling_params
    return [attrs.evolve(request, request_id=f"{i}_{request.request_id}",
                         sampling_params=params if params.seed is None else
                         attrs.evolve(params, seed=params.seed + i)) for i in range(n)]


def _request_id(prefix: str, body: CompletionRequest | ChatCompletionRequest) -> str:
    return body.request_id or f"{prefix}-{os.urandom(16).hex()}"


def _stop(body: CompletionRequest | ChatCompletionRequest) -> tuple[str, ...]:
    stop = body.stop
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


def _one_prompt(prompt: str | list[int] | list[str] | list[list[int]]
                ) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if not prompt:
        raise ApiError(400, "invalid request: prompt: must not be empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return None, [t for t in prompt if isinstance(t, int)]
    if len(prompt) != 1:
        raise ApiError(400, "invalid request: prompt: one prompt per request (a list of "
                       "several prompts is not supported yet)", "prompt")
    first = prompt[0]
    return (first, None) if isinstance(first, str) else (None, list(first))  # type: ignore[arg-type]


#: The defaults of create_app's limits (and of ``anyio-genout serve``'s options).
MAX_N = 16
MAX_BODY_SIZE = 1 << 20
BODY_TIMEOUT = 30.0


def create_app(text_client: TextClient, *, model_name: str, api_key: str | None = None,
               max_n: int = MAX_N, max_body_size: int = MAX_BODY_SIZE,
               max_concurrent_requests: int | None = None,
               body_timeout: float | None = BODY_TIMEOUT) -> FastAPI:
    """The OpenAI-compatible server's ASGI application (FastAPI) over ``text_client``.

    ``model_name`` is the one model ``/v1/models`` lists and requests may name (another
    one is 404). With ``api_key``, every route but ``/health`` needs
    ``Authorization: Bearer <api_key>`` (401 otherwise; compared in constant time).
    Limits: ``n`` at most ``max_n`` (400), a request body at most ``max_body_size`` bytes
    (413), ``max_tokens`` at most the engines' ``max_model_len`` (400), and with
    ``max_concurrent_requests`` at most that many completions and chat completions at once
    (429 beyond), and a body must arrive whole within ``body_timeout`` seconds (408).
    Serve it with any ASGI server; ``anyio-genout serve`` uses Hypercorn.
    See docs/server.md.
    """

    def check_n(n: int) -> None:
        if n > max_n:
            raise ApiError(400, f"invalid request: n: must be at most {max_n}, got {n}", "n")

    def check_max_tokens(max_tokens: int | None, field: str) -> None:
        limit = client.engine.max_model_len
        if max_tokens is not None and max_tokens > limit:
            raise ApiError(400, f"{field}={max_tokens} cannot be greater than "
                           f"max_model_len={limit}. Please request fewer output tokens.", field)

    expected = f"Bearer {api_key}".encode() if api_key is not None else None

    async def authorized(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise ApiError(401, "invalid API key")

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")

    client = text_client.client
    tokenizer = text_client.tokenizer

    def _decode_prompt(ids: list[int] | None) -> str:
        assert ids is not None
        vocab = tokenizer.vocab_size
        for i, token in enumerate(ids):
            if not 0 <= token < vocab:  # the check the engine client makes, named as it is
                raise ApiError(400, f"invalid request: prompt[{i}]: {token} is not in the "
                               f"vocabulary (0..{vocab - 1})", f"prompt[{i}]")
        return tokenizer.decode(ids, skip_special_tokens=False)
    app = FastAPI(title="anyio-genout", docs_url=None, redoc_url=None)
    install_handlers(app)
    app.add_middleware(Limits, max_body_size=max_body_size,
                       max_concurrent_requests=max_concurrent_requests,
                       body_timeout=body_timeout,
                       limited_paths=frozenset({"/v1/completions", "/v1/chat/completions"}))
    api = APIRouter(dependencies=[Depends(authorized)])

    @app.get("/health")
    async def health() -> Response:
        error = client.engine.health_error
        if error is not None:
            raise error_for(error)
        return Response(status_code=200)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()),
            "owned_by": "anyio-genout", "root": model_name, "parent": None,
            "max_model_len": client.engine.max_model_len, "permission": []}]}

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(client.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        check_model(body.model)
        check_n(body.n)
        check_max_tokens(body.max_tokens, "max_tokens")
        _check_unicode(body.prompt, "prompt")
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "invalid request: echo: not supported with logprobs yet (it "
                           "needs the prompt's logprobs)", "echo")
        prompt, ids = _one_prompt(body.prompt)
        echo = None
        if body.echo:
            echo = prompt if prompt is not None else _decode_prompt(ids)
        request_id = _request_id("cmpl", body)
        request = TextRequest(
            request_id=request_id, prompt=prompt, prompt_token_ids=ids,
            sampling_params=_sampling(body, body.max_tokens, body.logprobs),
            stop=_stop(body), include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            add_special_tokens=body.add_special_tokens if prompt is not None else None)
        return TextResponse(text_client, _choices(request, body.n),
                            CompletionFormat(request_id, model_name, body.logprobs, echo),
                            stream=body.stream, include_usage=_usage(body))

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        check_model(body.model)
        check_n(body.n)
        check_max_tokens(body.max_completion_tokens, "max_completion_tokens")
        check_max_tokens(body.max_tokens, "max_tokens")
        _check_unicode(body.messages, "messages")
        _check_unicode(body.chat_template_kwargs, "chat_template_kwargs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "invalid request: top_logprobs: needs logprobs=true",
                           "top_logprobs")
        request_id = _request_id("chatcmpl", body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        request = TextRequest(
            request_id=request_id, messages=body.messages,
            sampling_params=_sampling(body, max_tokens, top),
            stop=_stop(body), include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs)
        return TextResponse(text_client, _choices(request, body.n),
                            ChatFormat(request_id, model_name, top), stream=body.stream,
                            include_usage=_usage(body))

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "invalid request: prompt: give exactly one of prompt and "
                           "messages", "prompt")
        _check_unicode(body.prompt, "prompt")
        _check_unicode(body.messages, "messages")
        try:
            if body.messages is not None:
                text = tokenizer.apply_chat_template(
                    body.messages, add_generation_prompt=body.add_generation_prompt)
                ids = tokenizer.encode(text, add_special_tokens=False)
            else:
                assert body.prompt is not None
                ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
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
        vocab = tokenizer.vocab_size
        for i, token in enumerate(body.tokens):
            if not 0 <= token < vocab:
                raise ApiError(400, f"invalid request: tokens[{i}]: {token} is not in the "
                               f"vocabulary (0..{vocab - 1})", f"tokens[{i}]")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})

    app.include_router(api)
    return app


def _usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage
