"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.detokenizer import decode_token
from pagedllm.entrypoints.chat_utils import load_chat_template, render_chat_template, resolve_content_format
from pagedllm.entrypoints.logger import RequestLogger
from pagedllm.entrypoints.openai.cli_args import FrontendArgs
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatResponseMessage,
    ChatStreamChoice, ChatTokenLogprob, ChatTopLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, DeltaMessage, DetokenizeRequest, DetokenizeResponse, ErrorInfo, ErrorResponse, ModelCard,
    ModelList, PromptTokenUsageInfo, SamplingRequest, TokenizeRequest, TokenizeResponse, UsageInfo,
)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.version import __version__

logger = logging.getLogger("pagedllm")

_DISCONNECT_POLL_S = 0.5
_MIN_LOGPROB = -9999.0  # what OpenAI sends for -inf (JSON has no infinity)
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "InternalServerError"),
                                         param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def _sse(obj: Any) -> str:
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests as they come, tagged with their stream's index.
    Closing this closes (and so aborts) every stream still running."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            with contextlib.suppress(Exception):
                await s.aclose()


class APIKeyMiddleware:
    """401 on /v1/* without 'Authorization: Bearer KEY'. Plain ASGI (not BaseHTTPMiddleware),
    so handlers still see the client's disconnect."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        # CORS preflights carry no credentials (vLLM lets them through too).
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and _route_path(scope).startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(401, "Invalid or missing API key (Authorization: Bearer ...)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _route_path(scope: dict) -> str:
    """The path the routes see: without a --root-path prefix that the proxy left in place."""
    path, root = scope["path"], scope.get("root_path") or ""
    if root and (path == root or path.startswith(root.rstrip("/") + "/")):
        return path[len(root.rstrip("/")):] or "/"
    return path


class RequestIdMiddleware:
    """An X-Request-Id header on every response: the client's, or a new one, which is also put on
    the request so that it names the engine request (`cmpl-<id>`)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id")
        if not request_id:
            request_id = uuid.uuid4().hex.encode()
            scope = {**scope, "headers": [*scope["headers"], (b"x-request-id", request_id)]}

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class OpenAIServing:
    """The request handlers, independent of FastAPI's routing."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], chat_template: Optional[str], *,
                 content_format: str = "auto", response_role: str = "assistant",
                 request_logger: Optional[RequestLogger] = None, enable_prompt_tokens_details: bool = False) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.chat_template = load_chat_template(chat_template)
        resolve_content_format(content_format, None)  # a bad value fails at start-up
        self.content_format = content_format
        self.response_role = response_role
        self.request_logger = request_logger
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.defaults = engine.model_config.default_sampling_overrides()
        self.tokenizer = engine.get_tokenizer()

    @staticmethod
    def request_id(prefix: str, raw: Request, req: SamplingRequest) -> str:
        """vLLM's rule: the client's X-Request-Id, else the body's request_id, else a random one."""
        return f"{prefix}-{raw.headers.get('x-request-id') or req.request_id or uuid.uuid4().hex}"

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        details = PromptTokenUsageInfo(cached_tokens=cached_tokens) if self.enable_prompt_tokens_details else None
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)

    def model_name(self, requested: Optional[str]) -> str:
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist; served: {self.served_model_names}",
                           param="model")
        return requested

    def _add(self, request_id: str, prompts: list[dict[str, Any]], params: SamplingParams, priority: int
             ) -> tuple[list[str], list[AsyncIterator]]:
        ids, streams = [], []
        try:
            for i, prompt in enumerate(prompts):
                rid = f"{request_id}-{i}" if len(prompts) > 1 else request_id
                if self.request_logger is not None:
                    self.request_logger.log_inputs(rid, prompt.get("prompt"), prompt.get("prompt_token_ids"), params)
                streams.append(self.engine.add_request(rid, prompt, params, priority=priority))
                ids.append(rid)
        except BaseException:
            self.engine.abort(ids)
            raise
        return ids, streams

    async def _collect(self, raw: Request, ids: list[str], streams: list[AsyncIterator]) -> list[RequestOutput]:
        """The final output of every stream; aborts all if the client goes away meanwhile."""
        finals: list[Optional[RequestOutput]] = [None] * len(streams)

        async def run() -> None:
            async for i, out in _merge(streams):
                finals[i] = out

        task = asyncio.ensure_future(run())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    break
                if await raw.is_disconnected():
                    return []
            task.result()  # re-raises a request's error (ValueError -> 400)
            return [f for f in finals if f is not None]
        finally:
            if not task.done():
                task.cancel()  # closes the streams, which aborts their requests
            self.engine.abort(ids)

    # ---- /v1/completions ---------------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list[dict[str, Any]]:
        """The request's prompts as TokensPrompts (text ones tokenized here, per add_special_tokens)."""
        prompt = req.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(t, int) for t in prompt):
            return [{"prompt_token_ids": prompt}]
        if all(isinstance(p, str) for p in prompt):
            encode = self.tokenizer.encode
            return [{"prompt": p, "prompt_token_ids": encode(p, add_special_tokens=req.add_special_tokens)}
                    for p in prompt]
        return [{"prompt_token_ids": p} for p in prompt]

    def _prompt_text(self, ro: RequestOutput) -> str:
        return ro.prompt if ro.prompt is not None else self.tokenizer.decode(ro.prompt_token_ids)

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[Optional[dict[int, Logprob]]],
                             text_offset: int) -> tuple[CompletionLogprobs, int]:
        """The logprobs block of `token_ids` (a None position, the first prompt token, has no
        logprob) and the text offset after the last token."""
        lp = CompletionLogprobs()
        for tid, candidates in zip(token_ids, logprobs):
            if candidates is None:
                token = decode_token(self.tokenizer, tid)
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                token = candidates[tid].decoded_token or ""
                lp.token_logprobs.append(max(candidates[tid].logprob, _MIN_LOGPROB))
                lp.top_logprobs.append({c.decoded_token or "": max(c.logprob, _MIN_LOGPROB)
                                        for c in candidates.values()})
            lp.tokens.append(token)
            lp.text_offset.append(text_offset)
            text_offset += len(token)
        return lp, text_offset

    @staticmethod
    def _echoed_prompt_logprobs(ro: RequestOutput, prompt_logprobs: Optional[list]) -> list:
        return list(prompt_logprobs) if prompt_logprobs is not None else [None] * len(ro.prompt_token_ids)

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Any:
        model = self.model_name(req.model)
        params = req.to_sampling_params(self.defaults)
        prompts = self.completion_prompts(req)
        request_id = self.request_id("cmpl", raw, req)
        ids, streams = self._add(request_id, prompts, params, req.priority)
        if req.stream:
            return StreamingResponse(self._sse_guard(self._completion_stream(req, model, request_id, streams), ids),
                                     media_type="text/event-stream")
        finals = await self._collect(raw, ids, streams)
        if len(finals) != len(ids):
            return Response(status_code=499)  # the client left; nobody reads this
        choices = []
        for pi, ro in enumerate(finals):
            for out in ro.outputs:
                prefix = self._prompt_text(ro) if req.echo else ""
                logprobs = None
                if req.logprobs is not None:
                    token_ids, lps = out.token_ids, list(out.logprobs or [])
                    if req.echo:  # the prompt's tokens first, as vLLM and OpenAI report them
                        token_ids = ro.prompt_token_ids + token_ids
                        lps = self._echoed_prompt_logprobs(ro, ro.prompt_logprobs) + lps
                    logprobs, _ = self._completion_logprobs(token_ids, lps, 0)
                choices.append(CompletionChoice(index=pi * req.n + out.index, text=prefix + out.text,
                                                logprobs=logprobs, finish_reason=out.finish_reason,
                                                stop_reason=out.stop_reason))
        usage = self.usage(sum(len(ro.prompt_token_ids) for ro in finals),
                           sum(len(o.token_ids) for ro in finals for o in ro.outputs),
                           sum(ro.num_cached_tokens for ro in finals))
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _sse_guard(self, events: AsyncIterator[str], ids: list[str]) -> AsyncIterator[str]:
        """A stream's server-sent events, then errors as an error event, then `[DONE]`; the
        requests are aborted however the stream ends (a no-op for finished ones)."""
        try:
            async for event in events:
                yield event
        except ValueError as e:
            yield _sse(ErrorResponse(error=ErrorInfo(message=str(e), type="BadRequestError", code=400)))
        except EngineDeadError as e:
            yield _sse(ErrorResponse(error=ErrorInfo(message=str(e), type="ServiceUnavailableError", code=503)))
        finally:
            self.engine.abort(ids)
        yield "data: [DONE]\n\n"

    async def _completion_stream(self, req: CompletionRequest, model: str, request_id: str,
                                 streams: list[AsyncIterator]) -> AsyncIterator[str]:
        created = int(time.time())
        prompt_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}
        prompt_logprobs: dict[int, list] = {}
        completion_tokens = 0
        echoed: set[int] = set()
        offsets: dict[int, int] = {}  # text offset of each choice's next token
        async for pi, ro in _merge(streams):
            prompt_tokens[pi], cached_tokens[pi] = len(ro.prompt_token_ids), ro.num_cached_tokens
            if ro.prompt_logprobs is not None:  # sent once per prompt, whole
                prompt_logprobs[pi] = ro.prompt_logprobs
            for out in ro.outputs:
                index = pi * req.n + out.index
                completion_tokens += len(out.token_ids)
                if not out.text and out.finish_reason is None and not out.token_ids:
                    continue
                text, token_ids, lps = out.text, out.token_ids, list(out.logprobs or [])
                if req.echo and index not in echoed:
                    echoed.add(index)
                    text = self._prompt_text(ro) + text
                    token_ids = ro.prompt_token_ids + token_ids
                    lps = self._echoed_prompt_logprobs(ro, prompt_logprobs.get(pi)) + lps
                logprobs = None
                if req.logprobs is not None:
                    logprobs, offsets[index] = self._completion_logprobs(token_ids, lps, offsets.get(index, 0))
                chunk = CompletionResponse(id=request_id, created=created, model=model, choices=[
                    CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                                     stop_reason=out.stop_reason)])
                yield _sse(chunk)
        if req.stream_options and req.stream_options.include_usage:
            usage = self.usage(sum(prompt_tokens.values()), completion_tokens, sum(cached_tokens.values()))
            yield _sse(CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage))

    # ---- /v1/chat/completions ----------------------------------------------------------------------
    # ---- /tokenize and /detokenize ------------------------------------------------------------------
    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`", param="prompt")
        if req.messages is not None:
            ids = self.chat_prompt(req)["prompt_token_ids"]
        else:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.model_config.max_model_len, tokens=ids)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.model_name(req.model)
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            text = render_chat_template(
                self.tokenizer, messages, chat_template=req.chat_template or self.chat_template,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                content_format=self.content_format, **(req.chat_template_kwargs or {}))
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise ValueError(f"could not apply the chat template: {type(e).__name__}: {e}") from e
        # The template writes any BOS itself: tokenizing must not add another.
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def response_role_of(self, req: ChatCompletionRequest) -> str:
        """vLLM's rule: --response-role for a new reply, else the role of the message being continued."""
        return self.response_role if req.add_generation_prompt else req.messages[-1].role

    @staticmethod
    def _chat_logprobs(out: CompletionOutput, top: int) -> ChatLogprobs:
        content = []
        for tid, candidates in zip(out.token_ids, out.logprobs or []):
            sampled = candidates[tid]

            def entry(lp: Any) -> ChatTopLogprob:
                tok = lp.decoded_token or ""
                return ChatTopLogprob(token=tok, logprob=max(lp.logprob, _MIN_LOGPROB), bytes=list(tok.encode("utf-8")))

            ranked = sorted(candidates.values(), key=lambda c: c.rank if c.rank is not None else 0)[:top]
            content.append(ChatTokenLogprob(**entry(sampled).model_dump(), top_logprobs=[entry(c) for c in ranked]))
        return ChatLogprobs(content=content)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Any:
        model = self.model_name(req.model)
        params = req.to_sampling_params(self.defaults)
        prompt = self.chat_prompt(req)
        request_id = self.request_id("chatcmpl", raw, req)
        ids, streams = self._add(request_id, [prompt], params, req.priority)
        if req.stream:
            return StreamingResponse(self._sse_guard(self._chat_stream(req, model, request_id, streams), ids),
                                     media_type="text/event-stream")
        finals = await self._collect(raw, ids, streams)
        if not finals:
            return Response(status_code=499)
        ro = finals[0]
        top = req.top_logprobs or 0
        role = self.response_role_of(req)
        choices = [ChatChoice(index=o.index, message=ChatResponseMessage(role=role, content=o.text),
                              logprobs=self._chat_logprobs(o, top) if req.logprobs else None,
                              finish_reason=o.finish_reason, stop_reason=o.stop_reason) for o in ro.outputs]
        usage = self.usage(len(ro.prompt_token_ids), sum(len(o.token_ids) for o in ro.outputs), ro.num_cached_tokens)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _chat_stream(self, req: ChatCompletionRequest, model: str, request_id: str,
                           streams: list[AsyncIterator]) -> AsyncIterator[str]:
        created = int(time.time())
        prompt_tokens = completion_tokens = cached_tokens = 0

        def chunk(choices: list[ChatStreamChoice], usage_info: Optional[UsageInfo] = None) -> str:
            body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                       usage=usage_info).model_dump()
            for choice in body["choices"]:  # a delta carries only what it sets
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return _sse(body)

        role = self.response_role_of(req)
        for i in range(req.n):  # the role comes first, once per choice
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role=role, content=""))])
        async for _, ro in _merge(streams):
            prompt_tokens, cached_tokens = len(ro.prompt_token_ids), ro.num_cached_tokens
            for out in ro.outputs:
                completion_tokens += len(out.token_ids)
                if not out.text and out.finish_reason is None and not out.token_ids:
                    continue
                logprobs = self._chat_logprobs(out, req.top_logprobs or 0) if req.logprobs else None
                yield chunk([ChatStreamChoice(index=out.index, delta=DeltaMessage(content=out.text),
                                              logprobs=logprobs, finish_reason=out.finish_reason,
                                              stop_reason=out.stop_reason)])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], self.usage(prompt_tokens, completion_tokens, cached_tokens))


def build_app(engine: AsyncLLM, served_model_names: list[str], args: Optional[FrontendArgs] = None) -> FastAPI:
    """The FastAPI app over `engine`; `args` carries the server flags (`args.api_key` is used
    as given: the CLI resolves PAGEDLLM_API_KEY)."""
    args = args or FrontendArgs()
    serving = OpenAIServing(
        engine, served_model_names, args.chat_template, content_format=args.chat_template_content_format,
        response_role=args.response_role,
        request_logger=None if args.disable_log_requests else RequestLogger(args.max_log_len),
        enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    metrics_registry = ServerMetrics(served_model_names[0])
    engine.metrics = metrics_registry

    async def log_stats_forever() -> None:
        while True:
            await asyncio.sleep(engine.stat_logger.interval_s)
            engine.do_log_stats()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stats_task = asyncio.ensure_future(log_stats_forever()) if engine.log_stats else None
        yield
        if stats_task is not None:
            stats_task.cancel()
        engine.shutdown()
        logger.info("Engine shut down")

    docs = {} if not args.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__, lifespan=lifespan, **docs)
    # As vLLM does (the constructor's root_path is deprecated): routes match with or without the prefix.
    app.root_path = args.root_path or ""
    app.state.serving = serving

    # The last middleware added runs first: CORS, then X-Request-Id, then the API key check, so
    # that preflights are answered and even a 401 carries the CORS and X-Request-Id headers.
    if args.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    if args.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
                       allow_methods=args.allowed_methods, allow_headers=args.allowed_headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts, param = [], None
        for err in errors[:5]:
            if err.get("type") == "json_invalid":
                parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
                continue
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or (".".join(loc) or None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return error_response(400, "; ".join(parts) or "invalid request", param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), getattr(exc, "param", None))

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except EngineDeadError as e:
            return error_response(503, str(e))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> ModelList:
        mc = engine.model_config
        return ModelList(data=[ModelCard(id=name, root=mc.model, max_model_len=mc.max_model_len)
                               for name in served_model_names])

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await serving.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        return await serving.create_chat_completion(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return serving.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return serving.detokenize(req)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_registry.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/internal/stats")
    async def internal_stats() -> dict[str, Any]:
        """KV blocks and queue sizes of the engine core, for tests and debugging."""
        stats = await engine.get_stats()
        return {k: stats[k] for k in ("num_free_blocks", "num_blocks", "num_running", "num_waiting")} | {
            "num_unfinished_requests": engine.get_num_unfinished_requests()}

    return app
