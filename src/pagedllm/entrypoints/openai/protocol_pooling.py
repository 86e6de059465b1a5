"""Request and response bodies of the pooling endpoints: OpenAI's /v1/embeddings, and vLLM's
/pooling, /classify, /score and /rerank (Jina / Cohere shape)."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIModel

# A text, texts, token ids, or lists of token ids (OpenAI's embeddings input).
PoolingInput = Union[str, list[str], list[int], list[list[int]]]


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _PoolingRequest(OpenAIModel):
    model: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    priority: int = 0
    request_id: Optional[str] = None
    user: Optional[str] = None


class EmbeddingRequest(_PoolingRequest):
    """``input``, or ``messages`` rendered with the chat template (vLLM's chat-style embeddings)."""

    input: Optional[PoolingInput] = None
    messages: Optional[list[dict[str, Any]]] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    use_activation: Optional[bool] = None
    normalize: Optional[bool] = None  # vLLM's older name of use_activation
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False


class PoolingRequest(EmbeddingRequest):
    task: Optional[Literal["embed", "classify", "score", "reward", "encode"]] = None


class ClassificationRequest(_PoolingRequest):
    input: PoolingInput
    use_activation: Optional[bool] = None


class ScoreRequest(_PoolingRequest):
    """vLLM's /score: ``text_1`` against ``text_2`` (1:1, 1:N or N:N); ``queries`` /
    ``documents`` and ``data_1`` / ``data_2`` are other spellings of the two sides."""

    text_1: Optional[Union[str, list[str]]] = None
    text_2: Optional[Union[str, list[str]]] = None
    queries: Optional[Union[str, list[str]]] = None
    documents: Optional[Union[str, list[str]]] = None
    data_1: Optional[Union[str, list[str]]] = None
    data_2: Optional[Union[str, list[str]]] = None
    use_activation: Optional[bool] = None


class RerankRequest(_PoolingRequest):
    query: str
    documents: list[str]
    top_n: Optional[int] = Field(default=None, ge=0)
    return_documents: bool = True
    use_activation: Optional[bool] = None


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0


class EmbeddingData(OpenAIModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str]


class EmbeddingResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: _id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingData(OpenAIModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Union[list[Any], str]


class PoolingResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: _id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: UsageInfo


class ClassificationData(OpenAIModel):
    index: int
    label: Optional[str]
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: _id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreData(OpenAIModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: _id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(OpenAIModel):
    text: str


class RerankResult(OpenAIModel):
    index: int
    document: Optional[RerankDocument] = None
    relevance_score: float


class RerankResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: _id("rerank"))
    model: str
    usage: UsageInfo
    results: list[RerankResult]
