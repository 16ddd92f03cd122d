"""The FastAPI app: OpenAI-compatible completions and chat over one ``Engine``, /metrics, /health.

    app = create_app(engine, ServeConfig(model_name="kvlab-passphrase-qwen2"))
    uvicorn.run(app, host="127.0.0.1", port=8000)        # or: python -m kvlab.serve

A request's path: API key -> tenant (401), body read up to ``max_body_bytes`` (413), JSON (400),
strict fields (400), model name (404), prompt text up to ``max_prompt_bytes`` (400, before it is
tokenized), tokenized in a worker thread (never on the event loop: a big prompt stalls no other
request and not /health), prompt and limits checked against the model and the pool (400), then
queued for the engine thread (503 + ``Retry-After`` when the wait queue is full). Streaming answers
start with the first token and end with ``data: [DONE]``. A client that goes away aborts its
request. Every refusal is OpenAI's error object and touches no other request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..engine.engine import Engine
from ..engine.intake import RequestError, make_sampling
from ..engine.models import encode
from ..engine.sampling import SamplingParams
from .debug import engine_report
from .generation import ClientGone, Generation, OutputText, wait_or_disconnect
from .guard import RequestGuard
from .metrics import ServeMetrics
from .protocol import (
    PROMPT_BYTES_PER_TOKEN,
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_message,
)
from .runner import EngineRunner, EngineStoppedError, Job, QueueFullError, new_request_id, now
from .tenancy import AuthError, KeyTable

__all__ = ["ServeConfig", "create_app"]


@dataclass
class ServeConfig:
    """Server settings that are not the engine's own (the server secret is the engine's alone)."""

    model_name: str
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant; empty = open server
    max_waiting: int = 128  # requests queued beyond the engine's batch before 503
    max_body_bytes: int = 1 << 20
    # /v1/completions default (OpenAI's); chat defaults to the rest of the context
    completion_max_tokens: int = 16
    debug_endpoint: bool = False  # GET /debug/engine: invariants and leaked blocks (for load tests)
    # UTF-8 bytes of prompt text (a completion's prompt, a chat's message contents) accepted for
    # tokenizing; None = PROMPT_BYTES_PER_TOKEN x the model's context (max_body_bytes when the model
    # states no context)
    max_prompt_bytes: int | None = None
    # prompt tokens whose log-probabilities one request may ask for (echo with logprobs,
    # prompt_logprobs)
    max_prompt_logprob_tokens: int = 8192
    # seconds a POST's body may take to arrive (408 after; kvlab.serve.guard)
    body_timeout: float = 30.0
    metrics_open: bool = False  # GET /metrics without a key on a server with keys (--open-metrics)


# token ids in a prompt, messages in a chat, for a model that states no context
MAX_ITEMS_WITHOUT_CONTEXT = 1 << 16


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it passes ``limit`` bytes (declared or actually
    sent)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413,
            f"request body of {declared} bytes exceeds the limit of {limit}",
            code="request_too_large",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413, f"request body exceeds the limit of {limit} bytes", code="request_too_large"
            )
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
        # request bodies, one at a time
        self.decoder = ThreadPoolExecutor(1, thread_name_prefix="kvlab-decode")

    def tenant(self, request: Request) -> str | None:
        """The tenant of the request's API key (``None`` on an open server), or 401."""
        try:
            return self.keys.tenant_for(request.headers.get("authorization"))
        except AuthError as e:
            raise ApiError(401, str(e), code="invalid_api_key") from None

    # --- shared request handling ------------------------------------------------------------------
    async def parse(self, request: Request, model: type) -> tuple[object, str | None]:
        """Auth, body, JSON and fields: ``(body model, tenant)`` or ``ApiError``."""
        tenant = self.tenant(request)
        raw = await _read_body(request, self.config.max_body_bytes)
        # a 1 MB body takes tens of ms to parse and validate: in a worker thread, never on the event
        # loop; one thread for every body: a parse holds the GIL, and several at once would starve
        # the engine thread
        body = await asyncio.get_running_loop().run_in_executor(
            self.decoder, self.decode, raw, model
        )
        if body.model is not None and body.model != self.config.model_name:
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist; this server serves "
                f"{self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return body, tenant

    def decode(self, raw: bytes, model: type):
        """The body as ``model``: JSON, Unicode, the sizes of token-id lists and message lists, then
        the fields."""
        try:
            obj = json.loads(raw, parse_constant=_no_constants)
        except (ValueError, UnicodeDecodeError) as e:
            # ValueError covers numbers past the int-digit limit
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(
                400, "the body is not valid JSON: nested too deeply", code="invalid_json"
            ) from None
        if not isinstance(obj, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        self.check_counts(obj)  # first: a refused body costs no more work
        try:  # JSON may spell lone surrogates ("\ud800"): text no tokenizer, salt or log can encode
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                400,
                "the body is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff)",
                code="invalid_json",
            ) from None
        try:
            return model.model_validate(obj)
        except ValidationError as e:
            message, param = validation_message(e)
            raise ApiError(400, message, param=param, code="invalid_value") from None

    def check_counts(self, obj: dict) -> None:
        """Refuse a token-id list or a message list longer than the context, before it is validated
        or tokenized: no prompt can hold more tokens than the context, and every message templates
        to one token at least."""
        limit = self.engine.max_model_len or MAX_ITEMS_WITHOUT_CONTEXT
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if isinstance(prompt, list):
            lists = (
                [prompt]
                if prompt and isinstance(prompt[0], int)
                else [p for p in prompt if isinstance(p, list)]
            )
            if (n := max(map(len, lists), default=0)) > limit:
                raise ApiError(
                    400,
                    f"the prompt has {n} token ids; this model's context is {limit}",
                    param="prompt",
                    code="context_length_exceeded",
                )
        if isinstance(messages, list) and len(messages) > limit:
            raise ApiError(
                400,
                f"{len(messages)} messages: more than this model's context of {limit} tokens holds "
                "(each message is one token at least)",
                param="messages",
                code="context_length_exceeded",
            )

    def sampling(self, body, n_prompt: int, max_tokens: int | None, default: int, *, index: int = 0,
                 logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's sampling parameters of choice ``index``, with every limit checked (400
        naming the parameter).

        Choice ``index`` of a seeded request gets seed + index, as vLLM's parallel sampling gives
        its children.
        """
        limit = self.engine.max_model_len
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(
                400,
                f"max_tokens must be at least 1, got {max_tokens}",
                param="max_tokens",
                code="invalid_value",
            )
        if limit is not None and n_prompt >= limit:
            raise ApiError(
                400,
                f"the prompt has {n_prompt} tokens; this model's context is {limit}",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = default
        if limit is not None and n_prompt + max_tokens > limit:
            raise ApiError(
                400,
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                f"context of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        top_k = body.top_k if body.top_k not in (None, -1) else 0
        for name, ids in (
            ("stop_token_ids", body.stop_token_ids or ()),
            ("logit_bias", body.logit_bias or ()),
        ):
            if any(not 0 <= t < self.vocab for t in ids):
                raise ApiError(
                    400,
                    f"{name}: token ids must be in [0, {self.vocab})",
                    param=name,
                    code="invalid_value",
                )
        if prompt_logprobs is not None and not self.engine.runner.head_seam:
            raise ApiError(
                400,
                "prompt log-probabilities need the engine's LM-head seam, which this model lacks",
                param="prompt_logprobs",
                code="invalid_value",
            )
        fields = dict(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            seed=None if body.seed is None else body.seed + index,
            ignore_eos=bool(body.ignore_eos),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=body.logit_bias or {},
        )
        for name in (
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_p",
            "min_tokens",
        ):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        try:
            self.engine.intake.check_fits(n_prompt, max_tokens)
            return make_sampling(**fields)
        except RequestError as e:
            # the engine's intake names the field at fault: OpenAI's param
            raise ApiError(400, str(e), param=e.field, code="invalid_value") from None

    def check_text_size(self, size: int, param: str) -> None:
        """Refuse (400 naming ``param``) prompt text of more than ``max_prompt_bytes`` UTF-8 bytes,
        untokenized."""
        if size > self.max_prompt_bytes:
            raise ApiError(
                400,
                f"{param} holds {size} bytes of text; this server tokenizes at most "
                f"{self.max_prompt_bytes} bytes of prompt text (max_prompt_bytes)",
                param=param,
                code="context_length_exceeded",
            )

    def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """Token ids of a prompt, checked: non-empty, every id in the vocabulary.

        Blocking (the tokenizer runs here): call it through ``asyncio.to_thread``, never on the
        event loop.
        """
        ids = encode(self.tokenizer, prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param, code="invalid_value")
        if any(not 0 <= t < self.vocab for t in ids):
            raise ApiError(
                400, f"token ids must be in [0, {self.vocab})", param=param, code="invalid_value"
            )
        return ids

    def check_prompt_logprob_size(self, num_tokens: int) -> None:
        """Refuse (400) prompt log-probabilities (``echo`` with ``logprobs``, ``prompt_logprobs``)
        over more tokens than ``max_prompt_logprob_tokens`` in one request: each costs a row of the
        LM head and a JSON record."""
        limit = self.config.max_prompt_logprob_tokens
        if num_tokens > limit:
            raise ApiError(
                400,
                "prompt log-probabilities (echo with logprobs, or prompt_logprobs) of "
                f"{num_tokens} prompt tokens; this server returns them for at most {limit} tokens "
                "a request",
                param="echo",
                code="invalid_value",
            )

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                 add_special_tokens: bool = False) -> list[int]:
        """Token ids of chat messages rendered with the model's chat template (blocking, as
        ``prompt_ids``)."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as e:  # a template that refuses these messages (e.g. roles out of order)
            raise ApiError(400, f"the chat template refused the messages: {e}", param="messages",
                           code="invalid_value") from None
        size = len(text.encode("utf-8"))
        # the template's markup counts too (30k empty messages: 150k tokens)
        if size > self.max_prompt_bytes:
            raise ApiError(
                400,
                f"messages hold {size} bytes once the chat template is applied; this server "
                f"tokenizes at most {self.max_prompt_bytes} bytes of prompt text "
                "(max_prompt_bytes)",
                param="messages",
                code="context_length_exceeded",
            )
        if add_special_tokens:
            return self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return self.prompt_ids(text, "messages")

    def start(self, body, tenant: str | None, ids: list[int], sampling: SamplingParams, prefix: str,
              arrival: float) -> Generation:
        """Queue the request for the engine (503 when the queue is full); the engine derives its
        cache salt."""
        job = Job(new_request_id(prefix), ids, sampling, tenant, body.cache_salt)
        try:
            self.runner.submit(job)
        except QueueFullError as e:
            raise ApiError(503, f"the server is busy ({e}); retry later", code="server_overloaded",
                           headers={"Retry-After": "1"}) from None
        except EngineStoppedError as e:
            raise ApiError(503, str(e), code="engine_down") from None
        text = OutputText(
            self.tokenizer,
            body.stop or (),
            skip_special_tokens=body.skip_special_tokens is not False,
            include_stop=bool(body.include_stop_str_in_output),
        )
        return Generation(
            self.runner, self.metrics, job, text, arrival, want_ids=bool(body.return_token_ids)
        )

    def start_all(
        self, body, tenant: str | None, choices: list, prefix: str, arrival: float
    ) -> list[Generation]:
        """Queue every choice ``(ids, sampling)``; a refusal (503) ends the ones already queued."""
        gens: list[Generation] = []
        try:
            for ids, sampling in choices:
                gens.append(self.start(body, tenant, ids, sampling, prefix, arrival))
        except BaseException:
            for gen in gens:
                gen.close()
            raise
        return gens

    async def answer(self, request: Request, gens: list[Generation], body, render):
        """Wait for every choice's first token, then one JSON answer or an SSE stream of all
        choices.

        ``render(gens, pieces, first)``: pieces None = the whole answer (``gen.collect()``'s per
        choice), else ``(index, piece)`` for a chunk (piece None = the usage chunk).
        """
        try:
            await wait_or_disconnect(request, asyncio.gather(*(gen.first() for gen in gens)))
        except ClientGone:
            for gen in gens:
                gen.close()
            return Response(status_code=499)
        except BaseException:
            for gen in gens:
                gen.close()
            raise
        if not body.stream:
            try:
                done = await wait_or_disconnect(
                    request, asyncio.gather(*(gen.collect() for gen in gens))
                )
            except ClientGone:
                return Response(status_code=499)
            finally:
                for gen in gens:
                    gen.close()
            return JSONResponse(render(gens, done, True))
        return StreamingResponse(self.sse(gens, body, render), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def sse(self, gens: list[Generation], body, render) -> AsyncIterator[str]:
        """Server-sent events: one chunk per piece of any choice (each choice's first with its first
        token), usage if asked, [DONE]. Choices are generated together; their chunks interleave,
        each naming its ``index``."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, gen: Generation) -> None:
            try:
                async for piece in gen.pieces():
                    await queue.put((index, piece, None))
            except ApiError as e:
                await queue.put((index, None, e))
            finally:
                await queue.put((index, None, None))

        tasks = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(gens)]
        first = [True] * len(gens)
        try:
            left = len(gens)
            while left:
                index, piece, error = await queue.get()
                if error is not None:
                    yield _event(error.body())
                    break
                if piece is None:
                    left -= 1
                    continue
                yield _event(render(gens, (index, piece), first[index]))
                first[index] = False
            else:
                if body.include_usage:
                    yield _event(render(gens, (0, None), False))
        finally:
            for task in tasks:
                task.cancel()
            for gen in gens:
                # finished, failed, or cancelled because the client went away: abort, free, count
                gen.close()
        yield "data: [DONE]\n\n"


def prompt_byte_limit(config: ServeConfig, max_model_len: int | None) -> int:
    """The prompt-text limit in UTF-8 bytes: ``config.max_prompt_bytes``, else from the model's
    context."""
    if config.max_prompt_bytes is not None:
        if type(config.max_prompt_bytes) is not int or config.max_prompt_bytes < 1:
            raise ValueError(
                f"max_prompt_bytes must be a positive int, got {config.max_prompt_bytes!r}"
            )
        return config.max_prompt_bytes
    return PROMPT_BYTES_PER_TOKEN * max_model_len if max_model_len else config.max_body_bytes


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine: Engine, config: ServeConfig) -> FastAPI:
    """The OpenAI-compatible app over ``engine``; its engine thread starts and stops with the app's
    lifespan."""
    srv = _Server(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.runner.start(asyncio.get_running_loop())
        yield
        srv.runner.stop()
        srv.decoder.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="kvlab serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = srv
    # JSON content type on POSTs (415), a body deadline (408), /metrics behind the keys: before any
    # handler
    app.add_middleware(RequestGuard, keys=srv.keys, max_body_bytes=config.max_body_bytes,
                       body_timeout=config.body_timeout, metrics_open=config.metrics_open)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(Exception)
    # a bug: still OpenAI's shape
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        return _error(ApiError(500, f"internal error: {type(e).__name__}", code="internal_error"))

    @app.exception_handler(404)
    async def not_found(request: Request, e) -> JSONResponse:
        return _error(
            ApiError(404, f"no route {request.method} {request.url.path}", code="not_found")
        )

    @app.exception_handler(405)
    async def not_allowed(request: Request, e) -> JSONResponse:
        return _error(ApiError(405, f"method {request.method} not allowed on {request.url.path}",
                               code="method_not_allowed"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = now()
        body, tenant = await srv.parse(request, CompletionRequest)
        prompts = body.prompts
        srv.check_text_size(
            sum(len(p.encode("utf-8")) for p in prompts if isinstance(p, str)), "prompt"
        )
        # the tokenizer holds its thread for as long as the text takes: not the event loop's
        ids_list = await asyncio.to_thread(lambda: [srv.prompt_ids(p, "prompt") for p in prompts])
        n, k = body.n or 1, body.logprobs
        # echo with logprobs: the prompt's own log-probabilities too (vLLM sets prompt_logprobs =
        # logprobs)
        prompt_k = body.prompt_logprobs
        if body.echo and k is not None:
            prompt_k = max(k, prompt_k or 0)
        if prompt_k is not None:
            srv.check_prompt_logprob_size(sum(map(len, ids_list)))
        # vLLM's echo without generation: max_tokens 0 answers the prompt alone (one token is
        # computed, not sent)
        echo_only = bool(body.echo) and body.max_tokens == 0
        max_tokens = 1 if echo_only else body.max_tokens
        choices = []
        for ids in ids_list:
            for i in range(n):  # the prompt's log-probabilities once, with its first choice
                sampling = srv.sampling(
                    body,
                    len(ids),
                    max_tokens,
                    config.completion_max_tokens,
                    index=i,
                    logprobs=k,
                    prompt_logprobs=prompt_k if i == 0 else None,
                )
                choices.append((ids, sampling))
        gens = srv.start_all(body, tenant, choices, "cmpl", arrival)
        texts = [p if isinstance(p, str) else None for p in prompts]
        answer = _CompletionAnswer(srv, body, n, texts, prompt_k, echo_only)
        return await srv.answer(request, gens, body, answer.render)

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
        k = (body.top_logprobs or 0) if body.logprobs else None
        choices = [
            (
                ids,
                srv.sampling(
                    body,
                    len(ids),
                    max_tokens,
                    (limit - len(ids)) if limit else 16,
                    index=i,
                    logprobs=k,
                ),
            )
            for i in range(body.n or 1)
        ]
        gens = srv.start_all(body, tenant, choices, "chatcmpl", arrival)
        return await srv.answer(request, gens, body, _ChatAnswer(srv, body).render)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body, _ = await srv.parse(request, TokenizeRequest)
        if body.prompt is not None:
            srv.check_text_size(len(body.prompt.encode("utf-8")), "prompt")
            add = body.add_special_tokens is not False
            ids = await asyncio.to_thread(
                lambda: srv.tokenizer(body.prompt, add_special_tokens=add)["input_ids"]
            )
        else:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            srv.check_text_size(
                sum(len(m["content"].encode("utf-8")) for m in messages), "messages"
            )
            ids = await asyncio.to_thread(
                srv.chat_ids,
                messages,
                body.add_generation_prompt is not False,
                bool(body.add_special_tokens),
            )
        strs = srv.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body, _ = await srv.parse(request, DetokenizeRequest)
        if any(not 0 <= t < srv.vocab for t in body.tokens):
            raise ApiError(
                400, f"token ids must be in [0, {srv.vocab})", param="tokens", code="invalid_value"
            )
        return {"prompt": await asyncio.to_thread(srv.tokenizer.decode, body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/v1/models")
    async def models(request: Request):
        srv.tenant(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": srv.created,
                    "owned_by": "kvlab",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        if not srv.runner.alive:
            raise ApiError(
                503, f"the engine loop is not running ({srv.runner.error})", code="engine_down"
            )
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
            # in the engine, unknown to the server
            report["orphan_requests"] = len(ids - set(srv.runner.live))
            return report

    return app


# --- response bodies (OpenAI's shapes, vLLM's logprobs; token ids as vLLM's return_token_ids) -----
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvlab")
    except PackageNotFoundError:
        return "unknown"


def _usage(gens: list[Generation], n: int) -> dict:
    """Usage of all choices: each prompt counted once (its first choice's), every choice's tokens
    (as vLLM)."""
    firsts = gens[::n]
    prompt = sum(g.prompt_tokens for g in firsts)
    completion = sum(g.completion_tokens for g in gens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(g.num_cached_tokens for g in firsts)},
    }


class _Tokens:
    """Token strings of log-probability answers: ``decode([id])`` per token (vLLM's), remembered."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token: int) -> str:
        s = self.cache.get(token)
        if s is None:
            s = self.cache[token] = self.tokenizer.decode([token])
        return s

    def top(self, rec, k: int) -> list[tuple[int, float]]:
        """vLLM's dict of a step: the chosen token first, then the top ``k`` (each once)."""
        entries = {rec.token: rec.logprob}
        for t, lp in rec.top[:k]:
            entries.setdefault(t, lp)
        return list(entries.items())


class _CompletionAnswer:
    """/v1/completions answers: choices in prompt order, ``n`` per prompt (index = prompt x n +
    i)."""

    def __init__(self, srv: _Server, body: CompletionRequest, n: int, texts: list[str | None],
                 prompt_k: int | None, echo_only: bool = False) -> None:
        self.srv, self.body, self.n, self.texts, self.prompt_k = srv, body, n, texts, prompt_k
        self.echo_only = echo_only  # echo with max_tokens 0: the generated token is left out
        self.tok = _Tokens(srv.tokenizer)
        # characters of each choice's text sent so far (text_offset)
        self.offsets: dict[int, int] = {}

    def render(self, gens: list[Generation], x, first: bool) -> dict:
        out = {
            "id": gens[0].job.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": gens[0].metrics.model_name,
            "choices": [],
        }
        if isinstance(x, list):  # the whole answer
            for i, (gen, (text, ids, reason)) in enumerate(zip(gens, x)):
                out["choices"].append(self.choice(gens, i, text, ids, reason, gen.logprobs, True))
            out["usage"] = _usage(gens, self.n)
            return out
        index, piece = x
        if piece is None:
            out["usage"] = _usage(gens, self.n)
            return out
        out["choices"].append(
            self.choice(
                gens, index, piece.text, piece.token_ids, piece.finish_reason, piece.logprobs, first
            )
        )
        return out

    def _prompt_part(
        self, gens: list[Generation], index: int
    ) -> tuple[list[int], list | None, str]:
        """The prompt's ids, records (its first choice's) and text, for ``echo`` and
        ``prompt_logprobs``."""
        head = gens[index - index % self.n]
        ids = head.job.prompt_ids
        text = self.texts[index // self.n]
        if text is None:
            text = self.srv.tokenizer.decode(ids)
        return ids, head.prompt_logprobs, text

    def choice(
        self, gens, index: int, text: str, ids: list[int], reason, records, first: bool
    ) -> dict:
        body, gen = self.body, gens[index]
        k = body.logprobs
        if self.echo_only:
            text, ids, records = "", [], []
        lp_ids, lp_recs, prefix = [], [], ""
        if first and (body.echo or body.prompt_logprobs is not None):
            p_ids, p_recs, p_text = self._prompt_part(gens, index)
            if body.echo:
                prefix = p_text
                if k is not None:
                    lp_ids, lp_recs = list(p_ids), list(p_recs or [None] * len(p_ids))
        choice = {"index": index, "text": prefix + text, "logprobs": None, "finish_reason": reason}
        if k is not None:
            lp_ids += ids
            lp_recs += list(records or [])
            start = self.offsets.get(index, 0)
            choice["logprobs"] = self.logprobs(lp_ids, lp_recs, k, start)
        self.offsets[index] = self.offsets.get(index, 0) + len(prefix) + len(text)
        if first and body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(
                p_recs or [], body.prompt_logprobs
            )
        if gen.want_ids:
            choice["token_ids"] = ids
            if first:
                choice["prompt_token_ids"] = gen.job.prompt_ids
        return choice

    def logprobs(self, ids: list[int], records: list, k: int, offset: int) -> dict:
        """OpenAI's completion logprobs: tokens, token_logprobs, top_logprobs (the chosen + top k),
        text_offset."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, rec in zip(ids, records):
            s = self.tok(t)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if rec is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(max(rec.logprob, -9999.0))
                tops.append({self.tok(i): max(lp, -9999.0) for i, lp in self.tok.top(rec, k)})
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def vllm_prompt_logprobs(self, records: list, k: int) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {id: {logprob, rank,
        decoded_token}}."""
        out = []
        for rec in records:
            if rec is None:
                out.append(None)
                continue
            entries = {}
            for t, lp in self.tok.top(rec, k):
                rank = rec.rank if t == rec.token else 1 + [i for i, _ in rec.top].index(t)
                entries[str(t)] = {"logprob": lp, "rank": rank, "decoded_token": self.tok(t)}
            out.append(entries)
        return out


class _ChatAnswer:
    """/v1/chat/completions answers: ``n`` choices, OpenAI's chat logprobs (``content``) when
    asked."""

    def __init__(self, srv: _Server, body: ChatRequest) -> None:
        self.srv, self.body, self.n = srv, body, body.n or 1
        self.tok = _Tokens(srv.tokenizer)

    def render(self, gens: list[Generation], x, first: bool) -> dict:
        gen0 = gens[0]
        if isinstance(x, list):
            choices = []
            for i, (gen, (text, ids, reason)) in enumerate(zip(gens, x)):
                choice = {"index": i, "message": {"role": "assistant", "content": text},
                          "logprobs": self.logprobs(gen.logprobs), "finish_reason": reason}
                if gen.want_ids:
                    choice["token_ids"] = ids
                choices.append(choice)
            out = {
                "id": gen0.job.request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": gen0.metrics.model_name,
                "choices": choices,
                "usage": _usage(gens, self.n),
            }
            if gen0.want_ids:
                out["prompt_token_ids"] = gen0.job.prompt_ids
            return out
        out = {
            "id": gen0.job.request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": gen0.metrics.model_name,
            "choices": [],
        }
        index, piece = x
        if piece is None:
            out["usage"] = _usage(gens, self.n)
            return out
        delta = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
        choice = {"index": index, "delta": delta, "logprobs": self.logprobs(piece.logprobs),
                  "finish_reason": piece.finish_reason}
        if gens[index].want_ids:
            choice["token_ids"] = piece.token_ids
            if first:
                out["prompt_token_ids"] = gens[index].job.prompt_ids
        out["choices"].append(choice)
        return out

    def _entry(self, token: int, logprob: float) -> dict:
        s = self.tok(token)
        return {
            "token": s,
            "logprob": max(logprob, -9999.0),
            "bytes": list(s.encode("utf-8", errors="replace")),
        }

    def logprobs(self, records: list | None) -> dict | None:
        """OpenAI's chat logprobs: per token, its entry and ``top_logprobs`` (vLLM's order: the
        chosen first)."""
        if not self.body.logprobs:
            return None
        k = self.body.top_logprobs or 0
        return {
            "content": [
                {
                    **self._entry(rec.token, rec.logprob),
                    "top_logprobs": [self._entry(t, lp) for t, lp in self.tok.top(rec, k)[:k]],
                }
                for rec in records or []
            ]
        }
