"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import envs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.entrypoints.logger import RequestLogger
from pagedllm.entrypoints.openai.cli_args import FrontendArgs
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.middleware import APIKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, LoadLoRAAdapterRequest,
    ModelList, TokenizeRequest, TokenizeResponse, UnloadLoRAAdapterRequest,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import APIError, error_response
from pagedllm.entrypoints.openai.serving_models import ServingModels
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedllm.entrypoints.openai.protocol_pooling import (
    ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest,
)
from pagedllm.version import __version__

logger = logging.getLogger("pagedllm")


_ENGINE_WATCH_S = 0.5


async def _watch_engine(app: FastAPI, engine: AsyncLLM, exit_on_death: bool) -> None:
    """vLLM's rule: when the engine core dies the server goes too (non-zero exit, cause logged),
    so a supervisor restarts it; in-flight requests get their error first."""
    while True:
        await asyncio.sleep(_ENGINE_WATCH_S)
        try:
            await engine.check_health()
        except EngineDeadError as e:
            app.state.engine_dead_reason = str(e)
            if not exit_on_death:
                logger.error("The engine core died (%s); answering 503 from now on (--keep-serving-without-engine)", e)
                return
            logger.error("The engine core died (%s); shutting the server down", e)
            await asyncio.sleep(1.0)  # the output loop hands each in-flight request its error
            server = getattr(app.state, "uvicorn_server", None)  # set by `pagedllm serve`
            if server is not None:
                server.should_exit = True  # uvicorn's graceful shutdown; the CLI then exits 1
            else:
                os.kill(os.getpid(), signal.SIGTERM)
            return


def _lifespan(engine: AsyncLLM, exit_on_death: bool = True):
    """The periodic stats line and the engine watch while the server runs; the engine shut
    down when it stops."""

    async def log_stats_forever() -> None:
        while True:
            await asyncio.sleep(engine.stat_logger.interval_s)
            engine.do_log_stats()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stats_task = asyncio.ensure_future(log_stats_forever()) if engine.log_stats else None
        watch_task = asyncio.ensure_future(_watch_engine(app, engine, exit_on_death))
        yield
        watch_task.cancel()
        if stats_task is not None:
            stats_task.cancel()
        engine.shutdown()
        logger.info("Engine shut down")

    return lifespan


def build_app(engine: AsyncLLM, served_model_names: list[str], args: Optional[FrontendArgs] = None) -> FastAPI:
    """The FastAPI app over `engine`; `args` carries the server flags (`args.api_key` is used
    as given: the CLI resolves PAGEDLLM_API_KEY)."""
    args = args or FrontendArgs()
    serving_kwargs = dict(
        content_format=args.chat_template_content_format, response_role=args.response_role,
        request_logger=None if args.disable_log_requests else RequestLogger(args.max_log_len),
        enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    # The chat handler also serves /tokenize and /detokenize (the base class's, chat template included).
    serving = OpenAIServingChat(engine, served_model_names, args.chat_template, **serving_kwargs,
                                enable_auto_tool_choice=args.enable_auto_tool_choice,
                                tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    completion = OpenAIServingCompletion(engine, served_model_names, args.chat_template, **serving_kwargs)
    if args.lora_modules and engine.processor.lora_config is None:
        raise ValueError("--lora-modules needs --enable-lora")
    pooling = OpenAIServingPooling(engine, served_model_names, args.chat_template, **serving_kwargs)
    serving.models = completion.models = pooling.models = ServingModels(engine, served_model_names, args.lora_modules)
    metrics_registry = ServerMetrics(served_model_names[0])
    engine.metrics = metrics_registry

    docs = {} if not args.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__, lifespan=_lifespan(engine, not args.keep_serving_without_engine), **docs)
    # As vLLM does (the constructor's root_path is deprecated): routes match with or without the prefix.
    app.root_path = args.root_path or ""
    app.state.engine_dead_reason = None
    app.state.serving = serving

    # The last middleware added runs first: CORS, then X-Request-Id, then the API key check, so
    # that preflights are answered and even a 401 carries the CORS and X-Request-Id headers.
    if args.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    if args.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes)
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
                       allow_methods=args.allowed_methods, allow_headers=args.allowed_headers)

    _add_error_handlers(app)
    _add_routes(app, engine, served_model_names, serving, completion, metrics_registry)
    _add_pooling_routes(app, pooling)
    if envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING:
        _add_lora_routes(app, serving.models)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style error body."""

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


def _add_routes(app: FastAPI, engine: AsyncLLM, served_model_names: list[str], serving: OpenAIServingChat,
                completion: OpenAIServingCompletion, metrics_registry: ServerMetrics) -> None:
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
        return ModelList(data=serving.models.cards(mc.model, mc.max_model_len))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await completion.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        return await serving.create_chat_completion(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return await serving.off_loop(serving.tokenize, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return await serving.off_loop(serving.detokenize, req)

    @app.get("/metrics")
    async def metrics() -> Response:
        with contextlib.suppress(EngineDeadError):  # a dead engine: the last values, /health says why
            stats = await engine.get_stats()
            metrics_registry.set_queue_gauges(stats["num_running"], stats["num_waiting"], stats["kv_cache_usage"])
        return Response(metrics_registry.render(), media_type=CONTENT_TYPE_LATEST)

    if envs.PAGEDLLM_TORCH_PROFILER_DIR:  # vLLM's routes, there only while profiling is configured
        logger.warning("Profiling on: POST /start_profile and /stop_profile write the workers' traces to %s",
                       envs.PAGEDLLM_TORCH_PROFILER_DIR)

        @app.post("/start_profile")
        async def start_profile() -> Response:
            await engine.start_profile()
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            await engine.stop_profile()
            return Response(status_code=200)

    @app.get("/internal/stats")
    async def internal_stats() -> dict[str, Any]:
        """KV blocks and queue sizes of the engine core, for tests and debugging."""
        stats = await engine.get_stats()
        return {k: stats[k] for k in ("num_free_blocks", "num_blocks", "num_running", "num_waiting")} | {
            "num_unfinished_requests": engine.get_num_unfinished_requests()}


def _add_pooling_routes(app: FastAPI, pooling: OpenAIServingPooling) -> None:
    """OpenAI's embeddings, and vLLM's pooling, classification, score and rerank endpoints."""

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Any:
        return await pooling.create_embedding(req, raw)

    @app.post("/pooling")
    async def pool(req: PoolingRequest, raw: Request) -> Any:
        return await pooling.create_pooling(req, raw)

    @app.post("/classify")
    async def classify(req: ClassificationRequest, raw: Request) -> Any:
        return await pooling.create_classify(req, raw)

    for path in ("/score", "/v1/score"):
        @app.post(path)
        async def score(req: ScoreRequest, raw: Request) -> Any:
            return await pooling.create_score(req, raw)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        @app.post(path)
        async def rerank(req: RerankRequest, raw: Request) -> Any:
            return await pooling.create_rerank(req, raw)


def _add_lora_routes(app: FastAPI, models: ServingModels) -> None:
    """vLLM's runtime adapter endpoints, served when PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        if models.engine.processor.lora_config is None:
            raise APIError(400, "this server was started without --enable-lora", param="lora_name")
        models.load(req.lora_name, req.lora_path)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        models.unload(req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", status_code=200)
