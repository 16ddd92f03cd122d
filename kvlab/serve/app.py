"""The FastAPI app: OpenAI-compatible completions and chat over one ``Engine``, /metrics, /health.

    app = create_app(engine, ServeConfig(model_name="kvlab-passphrase-qwen2"))
    uvicorn.run(app, host="127.0.0.1", port=8000)        # or: python -m kvlab.serve

A request's path: API key -> tenant (401), body read up to ``max_body_bytes`` (413), JSON (400), strict
fields (400), model name (404), prompt text up to ``max_prompt_bytes`` (400, before it is tokenized),
tokenized in a worker thread (never on the event loop: a big prompt stalls no other request and not
/health), prompt and limits checked against the model and the pool (400), then queued for the engine
thread (503 + ``Retry-After`` when the wait queue is full). Streaming answers
start with the first token and end with ``data: [DONE]``. A client that goes away aborts its request.
Every refusal is OpenAI's error object and touches no other request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..engine.engine import Engine
from ..engine.intake import RequestError, make_sampling
from ..engine.models import encode
from ..engine.sampling import SamplingParams
from .debug import engine_report
from .generation import ClientGone, Generation, Piece, wait_or_disconnect
from .metrics import ServeMetrics
from .protocol import (
    PROMPT_BYTES_PER_TOKEN,
    ApiError,
    ChatRequest,
    CompletionRequest,
    validation_message,
)
from .runner import EngineRunner, EngineStoppedError, Job, QueueFullError, new_request_id, now
from .tenancy import AuthError, KeyTable
from .text import TextStream

__all__ = ["ServeConfig", "create_app"]


@dataclass
class ServeConfig:
    """Server settings that are not the engine's own (the server secret is the engine's alone)."""

    model_name: str
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant; empty = open server
    max_waiting: int = 128  # requests queued beyond the engine's batch before 503
    max_body_bytes: int = 1 << 20
    completion_max_tokens: int = 16  # /v1/completions default (OpenAI's); chat defaults to the rest of the context
    debug_endpoint: bool = False  # GET /debug/engine: invariants and leaked blocks (for load tests)
    # UTF-8 bytes of prompt text (a completion's prompt, a chat's message contents) accepted for tokenizing;
    # None = PROMPT_BYTES_PER_TOKEN x the model's context (max_body_bytes when the model states no context)
    max_prompt_bytes: int | None = None


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it passes ``limit`` bytes (declared or actually sent)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


class _Server:
    """Everything a handler needs: engine, runner, metrics, keys, config."""

    def __init__(self, engine: Engine, config: ServeConfig) -> None:
        self.engine, self.config = engine, config
        self.tokenizer = engine.tokenizer
        self.keys = KeyTable(config.api_keys)
        self.metrics = ServeMetrics(config.model_name)
        self.runner = EngineRunner(engine, config.max_waiting, on_step=self.metrics.on_step)
        self.vocab = engine.model.config.vocab_size
        self.created = int(time.time())
        self.max_prompt_bytes = prompt_byte_limit(config, engine.max_model_len)

    def tenant(self, request: Request) -> str | None:
        """The tenant of the request's API key (``None`` on an open server), or 401."""
        try:
            return self.keys.tenant_for(request.headers.get("authorization"))
        except AuthError as e:
            raise ApiError(401, str(e), code="invalid_api_key") from None

    # --- shared request handling --------------------------------------------------------------------
    async def parse(self, request: Request, model: type) -> tuple[object, str | None]:
        """Auth, body, JSON and fields: ``(body model, tenant)`` or ``ApiError``."""
        tenant = self.tenant(request)
        raw = await _read_body(request, self.config.max_body_bytes)
        try:
            obj = json.loads(raw, parse_constant=_no_constants)
        except (ValueError, UnicodeDecodeError) as e:  # ValueError covers numbers past the int-digit limit
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the body is not valid JSON: nested too deeply", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        try:  # JSON may spell lone surrogates ("\ud800"): text no tokenizer, salt or log can encode
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "the body is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff)",
                           code="invalid_json") from None
        try:
            body = model.model_validate(obj)
        except ValidationError as e:
            message, param = validation_message(e)
            raise ApiError(400, message, param=param, code="invalid_value") from None
        if body.model is not None and body.model != self.config.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", param="model", code="model_not_found")
        return body, tenant

    def sampling(self, body, n_prompt: int, max_tokens: int | None, default: int) -> SamplingParams:
        """The engine's sampling parameters, with every limit checked (400 naming the parameter)."""
        limit = self.engine.max_model_len
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens",
                           code="invalid_value")
        if limit is not None and n_prompt >= limit:
            raise ApiError(400, f"the prompt has {n_prompt} tokens; this model's context is {limit}",
                           param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = default
        if limit is not None and n_prompt + max_tokens > limit:
            raise ApiError(400, f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                                f"context of {limit} tokens", param="max_tokens", code="context_length_exceeded")
        top_k = body.top_k if body.top_k not in (None, -1) else 0
        try:
            self.engine.intake.check_fits(n_prompt, max_tokens)
            return make_sampling(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                                 top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k, seed=body.seed,
                                 ignore_eos=body.ignore_eos)
        except RequestError as e:
            # the engine's intake names the field at fault: OpenAI's param
            raise ApiError(400, str(e), param=e.field, code="invalid_value") from None

    def check_text_size(self, size: int, param: str) -> None:
        """Refuse (400 naming ``param``) prompt text of more than ``max_prompt_bytes`` UTF-8 bytes, untokenized."""
        if size > self.max_prompt_bytes:
            raise ApiError(400, f"{param} holds {size} bytes of text; this server tokenizes at most "
                                f"{self.max_prompt_bytes} bytes of prompt text (max_prompt_bytes)",
                           param=param, code="context_length_exceeded")

    def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """Token ids of a prompt, checked: non-empty, every id in the vocabulary.

        Blocking (the tokenizer runs here): call it through ``asyncio.to_thread``, never on the event loop.
        """
        ids = encode(self.tokenizer, prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param, code="invalid_value")
        if any(not 0 <= t < self.vocab for t in ids):
            raise ApiError(400, f"token ids must be in [0, {self.vocab})", param=param, code="invalid_value")
        return ids

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of chat messages rendered with the model's chat template (blocking, as ``prompt_ids``)."""
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template that refuses these messages (e.g. roles out of order)
            raise ApiError(400, f"the chat template refused the messages: {e}", param="messages",
                           code="invalid_value") from None
        return self.prompt_ids(text, "messages")

    def start(self, body, tenant: str | None, ids: list[int], sampling: SamplingParams, prefix: str,
              arrival: float) -> Generation:
        """Queue the request for the engine (503 when the queue is full); the engine derives its cache salt."""
        job = Job(new_request_id(prefix), ids, sampling, tenant, body.cache_salt)
        try:
            self.runner.submit(job)
        except QueueFullError as e:
            raise ApiError(503, f"the server is busy ({e}); retry later", code="server_overloaded",
                           headers={"Retry-After": "1"}) from None
        except EngineStoppedError as e:
            raise ApiError(503, str(e), code="engine_down") from None
        return Generation(self.runner, self.metrics, job, TextStream(self.tokenizer, body.stop or ()), arrival,
                          want_ids=body.return_token_ids)

    async def answer(self, request: Request, gen: Generation, body, render_full, render_chunk):
        """Wait for the first token, then a JSON answer or an SSE stream."""
        try:
            await wait_or_disconnect(request, gen.first())
        except ClientGone:
            gen.close()
            return Response(status_code=499)
        except BaseException:
            gen.close()
            raise
        if not body.stream:
            try:
                text, ids, reason = await wait_or_disconnect(request, gen.collect())
            except ClientGone:
                return Response(status_code=499)
            finally:
                gen.close()
            return JSONResponse(render_full(gen, text, ids, reason))
        return StreamingResponse(self.sse(gen, body, render_chunk), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def sse(self, gen: Generation, body, render_chunk) -> AsyncIterator[str]:
        """Server-sent events: one chunk per piece (the first with the first token), usage if asked, [DONE]."""
        first = True
        try:
            async for piece in gen.pieces():
                yield _event(render_chunk(gen, piece, first))
                first = False
            if body.include_usage:
                yield _event(render_chunk(gen, None, False))
        except ApiError as e:
            yield _event(e.body())
        finally:
            gen.close()  # finished, failed, or cancelled because the client went away: abort, free, count
        yield "data: [DONE]\n\n"


def prompt_byte_limit(config: ServeConfig, max_model_len: int | None) -> int:
    """The prompt-text limit in UTF-8 bytes: ``config.max_prompt_bytes``, else from the model's context."""
    if config.max_prompt_bytes is not None:
        if type(config.max_prompt_bytes) is not int or config.max_prompt_bytes < 1:
            raise ValueError(f"max_prompt_bytes must be a positive int, got {config.max_prompt_bytes!r}")
        return config.max_prompt_bytes
    return PROMPT_BYTES_PER_TOKEN * max_model_len if max_model_len else config.max_body_bytes


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine: Engine, config: ServeConfig) -> FastAPI:
    """The OpenAI-compatible app over ``engine``; its engine thread starts and stops with the app's lifespan."""
    srv = _Server(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.runner.start(asyncio.get_running_loop())
        yield
        srv.runner.stop()

    app = FastAPI(title="kvlab serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:  # a bug: still OpenAI's shape
        return _error(ApiError(500, f"internal error: {type(e).__name__}", code="internal_error"))

    @app.exception_handler(404)
    async def not_found(request: Request, e) -> JSONResponse:
        return _error(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, e) -> JSONResponse:
        return _error(ApiError(405, f"method {request.method} not allowed on {request.url.path}",
                               code="method_not_allowed"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = now()
        body, tenant = await srv.parse(request, CompletionRequest)
        if isinstance(body.prompt, str):
            srv.check_text_size(len(body.prompt.encode("utf-8")), "prompt")
        # the tokenizer holds its thread for as long as the text takes: not the event loop's
        ids = await asyncio.to_thread(srv.prompt_ids, body.prompt, "prompt")
        sampling = srv.sampling(body, len(ids), body.max_tokens, config.completion_max_tokens)
        gen = srv.start(body, tenant, ids, sampling, "cmpl", arrival)
        return await srv.answer(request, gen, body, _completion_full, _completion_chunk)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        arrival = now()
        body, tenant = await srv.parse(request, ChatRequest)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        srv.check_text_size(sum(len(m["content"].encode("utf-8")) for m in messages), "messages")
        # the template and the tokenizer run in a worker thread, as for completions
        ids = await asyncio.to_thread(srv.chat_ids, messages)
        limit = engine.max_model_len
        max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        sampling = srv.sampling(body, len(ids), max_tokens, (limit - len(ids)) if limit else 16)
        gen = srv.start(body, tenant, ids, sampling, "chatcmpl", arrival)
        return await srv.answer(request, gen, body, _chat_full, _chat_chunk)

    @app.get("/v1/models")
    async def models(request: Request):
        srv.tenant(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": srv.created,
                                            "owned_by": "kvlab", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        if not srv.runner.alive:
            raise ApiError(503, f"the engine loop is not running ({srv.runner.error})", code="engine_down")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if config.debug_endpoint:
        @app.get("/debug/engine")
        async def debug_engine(request: Request):
            # any configured key may read it (it shows every tenant's load): none, 401
            srv.tenant(request)
            report, ids = await srv.runner.call(lambda e: (engine_report(e), set(e.requests)))
            report["server_in_flight"] = len(srv.runner.live)
            report["orphan_requests"] = len(ids - set(srv.runner.live))  # in the engine, unknown to the server
            return report

    return app


# --- response bodies (OpenAI's shapes; token ids as vLLM's return_token_ids) ---------------------------
def _completion_full(gen: Generation, text: str, ids: list[int], reason: str) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    if gen.want_ids:
        choice.update(token_ids=ids, prompt_token_ids=gen.job.prompt_ids)
    return {"id": gen.job.request_id, "object": "text_completion", "created": int(time.time()),
            "model": gen.metrics.model_name, "choices": [choice], "usage": gen.usage()}


def _completion_chunk(gen: Generation, piece: Piece | None, first: bool) -> dict:
    out = {"id": gen.job.request_id, "object": "text_completion", "created": int(time.time()),
           "model": gen.metrics.model_name, "choices": []}
    if piece is None:
        out["usage"] = gen.usage()
        return out
    choice = {"index": 0, "text": piece.text, "logprobs": None, "finish_reason": piece.finish_reason}
    if gen.want_ids:
        choice["token_ids"] = piece.token_ids
        if first:
            choice["prompt_token_ids"] = gen.job.prompt_ids
    out["choices"].append(choice)
    return out


def _chat_full(gen: Generation, text: str, ids: list[int], reason: str) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}
    out = {"id": gen.job.request_id, "object": "chat.completion", "created": int(time.time()),
           "model": gen.metrics.model_name, "choices": [choice], "usage": gen.usage()}
    if gen.want_ids:
        choice["token_ids"] = ids
        out["prompt_token_ids"] = gen.job.prompt_ids
    return out


def _chat_chunk(gen: Generation, piece: Piece | None, first: bool) -> dict:
    out = {"id": gen.job.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
           "model": gen.metrics.model_name, "choices": []}
    if piece is None:
        out["usage"] = gen.usage()
        return out
    delta = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": piece.finish_reason}
    if gen.want_ids:
        choice["token_ids"] = piece.token_ids
        if first:
            out["prompt_token_ids"] = gen.job.prompt_ids
    out["choices"].append(choice)
    return out
