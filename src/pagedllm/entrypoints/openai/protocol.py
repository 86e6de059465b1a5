"""OpenAI API request and response models (with vLLM's extra sampling fields)."""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.structured_params import StructuredOutputsParams


class BadParam(ValueError):
    """A 400 for one request field, named in the error body's `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class PromptTokenUsageInfo(OpenAIModel):
    cached_tokens: Optional[int] = None


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Only with --enable-prompt-tokens-details: prompt tokens served from the prefix cache.
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model
    max_model_len: Optional[int] = None
    # What the model serves: "generate", or a pooling model's "embed" / "classify" / "reward".
    task: Optional[str] = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# Fields a client may send that this server does not implement yet: a 400 naming the field, never
# a silent 200 that ignores what the client asked for. (Other unknown fields are accepted and
# logged once per name, as vLLM does.)
UNSUPPORTED_FIELDS = {
    "guided_decoding_backend": "a per-request structured-outputs backend (the server's is set by "
                               "--structured-outputs-config)",
    "functions": "the legacy functions API (use tools)",
    "function_call": "the legacy functions API (use tool_choice)",
    "logits_processors": "per-request logits processors",
}


_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")


def _response_format_constraint(fmt: dict[str, Any]) -> dict[str, Any]:
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise ValueError("json_schema.schema must be a JSON schema object")
        return {"json": schema}
    raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {str(kind)[:40]!r}")


class SamplingRequest(OpenAIModel):
    """Fields both endpoints share; None means "the model's default"."""

    model_config = ConfigDict(extra="allow")  # unknown fields: checked and logged by the handler

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    # Bounded here: values a torch generator / int64 tensor cannot hold would fail in the engine.
    seed: Optional[int] = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM extras
    top_k: Optional[int] = Field(None, ge=-1, lt=2 ** 31)
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None
    priority: int = Field(0, ge=-(2 ** 63), lt=2 ** 63)
    # The engine request's id (after the endpoint's prefix); an X-Request-Id header wins.
    request_id: Optional[str] = Field(None, min_length=1, max_length=256)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and the older guided_* extras.
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None

    def _structured(self) -> Optional[StructuredOutputsParams]:
        """The one constraint the request asks for, by whichever name; two at once is a 400."""
        given = [n for n in _CONSTRAINT_FIELDS if getattr(self, n) is not None]
        if self.response_format is not None and self.response_format.get("type") == "text":
            given.remove("response_format")  # OpenAI's default: no constraint
        if len(given) > 1:
            raise BadParam(given[1], f"give one structured-output constraint, got {given}")
        if not given:
            return None
        name = given[0]
        try:
            if name == "response_format":
                kwargs = _response_format_constraint(self.response_format)
            elif name == "structured_outputs":
                kwargs = dict(self.structured_outputs)
            else:
                kwargs = {name.removeprefix("guided_"): getattr(self, name)}
            if self.guided_whitespace_pattern is not None:
                kwargs["whitespace_pattern"] = self.guided_whitespace_pattern
            return StructuredOutputsParams(**kwargs)
        except (TypeError, ValueError) as e:
            raise BadParam(name, f"{name}: {str(e)[:300]}") from None

    def _sampling_params(self, defaults: dict[str, Any], max_tokens: Optional[int], logprobs: Optional[int],
                         prompt_logprobs: Optional[int] = None) -> SamplingParams:
        def pick(name: str, fallback: Any) -> Any:
            v = getattr(self, name)
            return v if v is not None else defaults.get(name, fallback)

        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {sorted(self.logit_bias)}") from None
            if any(not -100.0 <= v <= 100.0 for v in logit_bias.values()):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {sorted(logit_bias.values())}")
        return SamplingParams(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            allowed_token_ids=self.allowed_token_ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens, logit_bias=logit_bias,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self._structured(),
        )


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    add_special_tokens: bool = True

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        if self.suffix:
            raise BadParam("suffix", "suffix is not supported: this server does no insertion (fill-in-the-middle) "
                                     "completions")
        if self.best_of is not None and self.best_of < self.n:
            raise BadParam("best_of", f"best_of must be >= n; got best_of={self.best_of}, n={self.n}")
        if self.best_of is not None and self.best_of > self.n:
            raise BadParam("best_of", f"best_of > n is not supported (no server-side ranking of candidates, as in "
                                      f"vLLM V1); got best_of={self.best_of}, n={self.n}: drop best_of or set it to n")
        # echo + logprobs reports the prompt's tokens too (vLLM's rule): their logprobs come from the engine.
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        if self.prompt_logprobs is not None:
            prompt_logprobs = max(self.prompt_logprobs, prompt_logprobs or 0)
        return self._sampling_params(defaults, self.max_tokens, self.logprobs, prompt_logprobs)


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatToolFunction(OpenAIModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: ChatToolFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    tools: Optional[list[ChatTool]] = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; None: "auto" with tools
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(defaults, max_tokens, logprobs)


# ---- responses -----------------------------------------------------------------------------------
class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(OpenAIModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ChatTopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    reasoning_content: Optional[str] = None  # --reasoning-parser; `reasoning` is vLLM's newer name
    reasoning: Optional[str] = None


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None


class DeltaMessage(OpenAIModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


def completion_chunk(request_id: str, created: int, model: str, index: int, text: str,
                     logprobs: Optional[CompletionLogprobs], finish_reason: Optional[str],
                     stop_reason: Optional[Union[int, str]]) -> dict:
    """One streamed completion choice as ``CompletionResponse(...).model_dump()`` has it, built as
    a dict: a stream makes one per token, and the models' validation was a tenth of the API
    process's work per token."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None if logprobs is None else logprobs.model_dump(),
                         "finish_reason": finish_reason, "stop_reason": stop_reason}], "usage": None}


def chat_chunk(request_id: str, created: int, model: str, choices: list[dict], usage: Optional[UsageInfo] = None) -> dict:
    """A ``ChatCompletionChunk(...).model_dump()`` built as a dict (see ``completion_chunk``);
    ``choices`` from ``chat_stream_choice``."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, "usage": None if usage is None else usage.model_dump()}


def chat_stream_choice(index: int, delta: DeltaMessage, logprobs: Optional[ChatLogprobs] = None,
                       finish_reason: Optional[str] = None, stop_reason: Optional[Union[int, str]] = None) -> dict:
    """A ``ChatStreamChoice``'s dump whose delta carries only the fields it sets."""
    return {"index": index, "delta": {k: v for k, v in delta.model_dump().items() if v is not None},
            "logprobs": None if logprobs is None else logprobs.model_dump(), "finish_reason": finish_reason,
            "stop_reason": stop_reason}


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)


# ---- /tokenize and /detokenize (vLLM's extra endpoints) --------------------------------------------
class TokenizeRequest(OpenAIModel):
    """Either a plain `prompt` or chat `messages` (rendered with the chat template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[ChatTool]] = None  # rendered by the chat template, as in a chat request


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str
