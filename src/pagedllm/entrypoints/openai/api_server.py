"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.entrypoints.chat_utils import apply_chat_template, load_chat_template
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatResponseMessage,
    ChatStreamChoice, ChatTokenLogprob, ChatTopLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, DeltaMessage, DetokenizeRequest, DetokenizeResponse, ErrorInfo, ErrorResponse, ModelCard,
    ModelList, TokenizeRequest, TokenizeResponse, UsageInfo, random_id,
)
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.version import __version__

logger = logging.getLogger("pagedllm")

_DISCONNECT_POLL_S = 0.5
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
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(401, "Invalid or missing API key (Authorization: Bearer ...)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIServing:
    """The request handlers, independent of FastAPI's routing."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], chat_template: Optional[str]) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.chat_template = load_chat_template(chat_template)
        self.defaults = engine.model_config.default_sampling_overrides()
        self.tokenizer = engine.get_tokenizer()

    def model_name(self, requested: Optional[str]) -> str:
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist; served: {self.served_model_names}",
                           param="model")
        return requested

    def _add(self, request_id: str, prompts: list[Any], params: Any) -> tuple[list[str], list[AsyncIterator]]:
        ids, streams = [], []
        try:
            for i, prompt in enumerate(prompts):
                rid = f"{request_id}-{i}" if len(prompts) > 1 else request_id
                streams.append(self.engine.add_request(rid, prompt, params))
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
    @staticmethod
    def completion_prompts(prompt: Any) -> list[Any]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(t, int) for t in prompt):
            return [{"prompt_token_ids": prompt}]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        return [{"prompt_token_ids": p} for p in prompt]

    def _prompt_text(self, ro: RequestOutput) -> str:
        return ro.prompt if ro.prompt is not None else self.tokenizer.decode(ro.prompt_token_ids)

    def _completion_logprobs(self, out: CompletionOutput, text_offset: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for tid, candidates in zip(out.token_ids, out.logprobs or []):
            sampled = candidates[tid]
            token = sampled.decoded_token or ""
            lp.tokens.append(token)
            lp.token_logprobs.append(sampled.logprob)
            lp.top_logprobs.append({c.decoded_token or "": c.logprob for c in candidates.values()})
            lp.text_offset.append(text_offset)
            text_offset += len(token)
        return lp

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Any:
        model = self.model_name(req.model)
        params = req.to_sampling_params(self.defaults)
        prompts = self.completion_prompts(req.prompt)
        request_id = random_id("cmpl")
        ids, streams = self._add(request_id, prompts, params)
        if req.stream:
            return StreamingResponse(self._sse_guard(self._completion_stream(req, model, request_id, streams), ids),
                                     media_type="text/event-stream")
        finals = await self._collect(raw, ids, streams)
        if len(finals) != len(ids):
            return Response(status_code=499)  # the client left; nobody reads this
        choices, usage = [], UsageInfo()
        for pi, ro in enumerate(finals):
            usage.prompt_tokens += len(ro.prompt_token_ids)
            for out in ro.outputs:
                usage.completion_tokens += len(out.token_ids)
                prefix = self._prompt_text(ro) if req.echo else ""
                logprobs = self._completion_logprobs(out, len(prefix)) if req.logprobs is not None else None
                choices.append(CompletionChoice(index=pi * req.n + out.index, text=prefix + out.text,
                                                logprobs=logprobs, finish_reason=out.finish_reason,
                                                stop_reason=out.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
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
        usage = UsageInfo()
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        counted_prompts: set[int] = set()
        async for pi, ro in _merge(streams):
            if pi not in counted_prompts:
                counted_prompts.add(pi)
                usage.prompt_tokens += len(ro.prompt_token_ids)
            for out in ro.outputs:
                index = pi * req.n + out.index
                usage.completion_tokens += len(out.token_ids)
                text = out.text
                if req.echo and index not in echoed:
                    echoed.add(index)
                    text = self._prompt_text(ro) + text
                if not text and out.finish_reason is None and not out.token_ids:
                    continue
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._completion_logprobs(out, offsets.get(index, len(text) - len(out.text)))
                offsets[index] = offsets.get(index, len(text) - len(out.text)) + len(out.text)
                chunk = CompletionResponse(id=request_id, created=created, model=model, choices=[
                    CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                                     stop_reason=out.stop_reason)])
                yield _sse(chunk)
        if req.stream_options and req.stream_options.include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
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
            ids = apply_chat_template(
                self.tokenizer, messages, chat_template=req.chat_template or self.chat_template,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                **(req.chat_template_kwargs or {}))
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise ValueError(f"could not apply the chat template: {type(e).__name__}: {e}") from e
        return {"prompt_token_ids": ids}

    @staticmethod
    def _chat_logprobs(out: CompletionOutput, top: int) -> ChatLogprobs:
        content = []
        for tid, candidates in zip(out.token_ids, out.logprobs or []):
            sampled = candidates[tid]

            def entry(lp: Any) -> ChatTopLogprob:
                tok = lp.decoded_token or ""
                return ChatTopLogprob(token=tok, logprob=lp.logprob, bytes=list(tok.encode("utf-8")))

            ranked = sorted(candidates.values(), key=lambda c: c.rank if c.rank is not None else 0)[:top]
            content.append(ChatTokenLogprob(**entry(sampled).model_dump(), top_logprobs=[entry(c) for c in ranked]))
        return ChatLogprobs(content=content)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Any:
        model = self.model_name(req.model)
        params = req.to_sampling_params(self.defaults)
        prompt = self.chat_prompt(req)
        request_id = random_id("chatcmpl")
        ids, streams = self._add(request_id, [prompt], params)
        if req.stream:
            return StreamingResponse(self._sse_guard(self._chat_stream(req, model, request_id, streams), ids),
                                     media_type="text/event-stream")
        finals = await self._collect(raw, ids, streams)
        if not finals:
            return Response(status_code=499)
        ro = finals[0]
        top = req.top_logprobs or 0
        choices = [ChatChoice(index=o.index, message=ChatResponseMessage(content=o.text),
                              logprobs=self._chat_logprobs(o, top) if req.logprobs else None,
                              finish_reason=o.finish_reason, stop_reason=o.stop_reason) for o in ro.outputs]
        completion_tokens = sum(len(o.token_ids) for o in ro.outputs)
        usage = UsageInfo(prompt_tokens=len(ro.prompt_token_ids), completion_tokens=completion_tokens,
                          total_tokens=len(ro.prompt_token_ids) + completion_tokens)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _chat_stream(self, req: ChatCompletionRequest, model: str, request_id: str,
                           streams: list[AsyncIterator]) -> AsyncIterator[str]:
        created = int(time.time())
        usage = UsageInfo()

        def chunk(choices: list[ChatStreamChoice], usage_info: Optional[UsageInfo] = None) -> str:
            body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                       usage=usage_info).model_dump()
            for choice in body["choices"]:  # a delta carries only what it sets
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return _sse(body)

        for i in range(req.n):  # the role comes first, once per choice
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        async for _, ro in _merge(streams):
            usage.prompt_tokens = len(ro.prompt_token_ids)
            for out in ro.outputs:
                usage.completion_tokens += len(out.token_ids)
                if not out.text and out.finish_reason is None and not out.token_ids:
                    continue
                logprobs = self._chat_logprobs(out, req.top_logprobs or 0) if req.logprobs else None
                yield chunk([ChatStreamChoice(index=out.index, delta=DeltaMessage(content=out.text),
                                              logprobs=logprobs, finish_reason=out.finish_reason,
                                              stop_reason=out.stop_reason)])
        if req.stream_options and req.stream_options.include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            yield chunk([], usage)


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: Optional[str] = None,
              chat_template: Optional[str] = None) -> FastAPI:
    serving = OpenAIServing(engine, served_model_names, chat_template)
    metrics_registry = ServerMetrics(served_model_names[0])
    engine.metrics = metrics_registry

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()
        logger.info("Engine shut down")

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.serving = serving

    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

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
        return error_response(400, str(exc))

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
