"""Shared pieces of the OpenAI request handlers: errors, SSE framing, the serving base class."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.entrypoints.chat_utils import load_chat_template, render_chat_template, resolve_content_format
from pagedllm.entrypoints.logger import RequestLogger
from pagedllm.entrypoints.openai.protocol import (
    BadParam, ChatCompletionRequest, DetokenizeRequest, DetokenizeResponse, ErrorInfo, ErrorResponse,
    PromptTokenUsageInfo, SamplingRequest, UNSUPPORTED_FIELDS, TokenizeRequest, TokenizeResponse, UsageInfo,
)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")
T = TypeVar("T")
# Bounded: two threads (the machine's cores) tokenize while the event loop serves everything else.
_LOGGED_EXTRA_FIELDS: set[str] = set()
_WORK_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagedllm-tokenize")


_DISCONNECT_POLL_S = 0.5
_MIN_LOGPROB = -9999.0  # what OpenAI sends for -inf (JSON has no infinity)
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError", 503: "ServiceUnavailableError"}


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
    Closing this closes (and so aborts) every stream still running. One stream (the usual
    request: one prompt, n=1) is read directly, without a task and a queue in between: per
    streamed token that hop was ~14% of the API process's work."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            with contextlib.suppress(Exception):
                await streams[0].aclose()
        return
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
        self.max_model_len = engine.model_config.max_model_len
        # One request holds at most max_num_seqs sequences (n, best_of): more would starve every other client.
        self.max_n = engine.config.scheduler_config.max_num_seqs
        # No vocabulary entry is longer than this many characters, so a text of more than
        # max_model_len times it cannot fit: refused before tokenizing it.
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Work proportional to the input (tokenize, chat template, detokenize) runs in a small
        thread pool, so /health and the streams keep their event loop (the fast tokenizers
        release the GIL while they encode)."""
        return await asyncio.get_running_loop().run_in_executor(_WORK_POOL, functools.partial(fn, *args))

    def check_text_length(self, text: str, param: str) -> None:
        if len(text) > self.max_model_len * self.max_token_chars:
            raise BadParam(param, f"the {param} has {len(text)} characters, more than max_model_len="
                                  f"{self.max_model_len} tokens can hold (at most {self.max_token_chars} characters "
                                  f"per token)")

    def check_request(self, req: SamplingRequest, params: SamplingParams) -> None:
        """Bounds one request's share of the engine: n (and best_of) at most max_num_seqs;
        fields this server does not implement are a 400, other unknown ones logged once."""
        if self.engine.model_config.runner_type == "pooling":
            raise APIError(400, f"The model `{self.served_model_names[0]}` is served as a pooling model: it does not "
                                "generate (use /v1/embeddings, /pooling, /classify, /score or /rerank)")
        for name in req.model_extra or {}:
            if name in UNSUPPORTED_FIELDS:
                raise BadParam(name, f"{name} is not supported by this server yet ({UNSUPPORTED_FIELDS[name]})")
            if name not in _LOGGED_EXTRA_FIELDS and len(_LOGGED_EXTRA_FIELDS) < 1000:
                _LOGGED_EXTRA_FIELDS.add(name)
                logger.warning("The request field %r is not known to this server and was ignored (logged once "
                               "per field name)", name[:64])
        for name in ("n", "best_of"):
            value = getattr(req, name, None)
            if value is not None and value > self.max_n:
                raise BadParam(name, f"{name}={value} is more than this server allows in one request "
                                     f"(max_num_seqs={self.max_n})")

    def check_context(self, prompt_token_ids: list[int], params: SamplingParams, kind: str) -> None:
        """vLLM's 400 when the prompt plus the requested completion cannot fit the context."""
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            return  # the prompt alone does not fit: the engine's own error names max_model_len
        if params.max_tokens is not None and n_prompt + params.max_tokens > self.max_model_len:
            raise BadParam("max_tokens", f"This model's maximum context length is {self.max_model_len} tokens. "
                                         f"However, you requested {n_prompt + params.max_tokens} tokens ({n_prompt} "
                                         f"in the {kind}, {params.max_tokens} in the completion). Please reduce "
                                         f"the length of the {kind} or completion.")

    @staticmethod
    def request_id(prefix: str, raw: Request, req: SamplingRequest) -> str:
        """vLLM's rule: the client's X-Request-Id, else the body's request_id, else a random one."""
        return f"{prefix}-{raw.headers.get('x-request-id') or req.request_id or uuid.uuid4().hex}"

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        details = PromptTokenUsageInfo(cached_tokens=cached_tokens) if self.enable_prompt_tokens_details else None
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)

    models: Optional[Any] = None  # serving_models.ServingModels: the base names and the LoRA adapters

    def model_name(self, requested: Optional[str]) -> str:
        if self.models is not None:
            name, _ = self.models.resolve(requested)
            if name:
                return name
            served = self.served_model_names + list(self.models.loras)
        else:
            if requested is None:
                return self.served_model_names[0]
            if requested in self.served_model_names:
                return requested
            served = self.served_model_names
        raise APIError(404, f"The model `{requested}` does not exist; served: {served}", param="model")

    def lora_request(self, model: str) -> Optional[Any]:
        return self.models.resolve(model)[1] if self.models is not None else None

    def _add(self, request_id: str, prompts: list[dict[str, Any]], params: SamplingParams, priority: int,
             model: Optional[str] = None) -> tuple[list[str], list[AsyncIterator]]:
        lora = self.lora_request(model) if model is not None else None
        ids, streams = [], []
        try:
            for i, prompt in enumerate(prompts):
                rid = f"{request_id}-{i}" if len(prompts) > 1 else request_id
                if self.request_logger is not None:
                    self.request_logger.log_inputs(rid, prompt.get("prompt"), prompt.get("prompt_token_ids"), params)
                streams.append(self.engine.add_request(rid, prompt, params, priority=priority, lora_request=lora))
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

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`", param="prompt")
        if req.messages is not None:
            ids = self.chat_prompt(req)["prompt_token_ids"]
        else:  # no length bound: counting a text longer than the context is what /tokenize is for
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
        kwargs = dict(req.chat_template_kwargs or {})
        if getattr(req, "tools", None):  # the template writes the tool definitions into the prompt
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        try:
            text = render_chat_template(
                self.tokenizer, messages, chat_template=req.chat_template or self.chat_template,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                content_format=self.content_format, **kwargs)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise ValueError(f"could not apply the chat template: {type(e).__name__}: {e}") from e
        self.check_text_length(text, "messages")
        # The template writes any BOS itself: tokenizing must not add another.
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
