"""pagedllm: high-throughput LLM inference with vLLM's API, in pure Python + Triton."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagedllm.logger import configure_logging
from pagedllm.version import __version__

configure_logging()

# Names load on first use, so `import pagedllm.core` stays free of torch and the CLI starts fast.
_LAZY = {
    "LLM": "pagedllm.entrypoints.llm",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "EngineArgs": "pagedllm.engine.arg_utils",
    "SamplingParams": "pagedllm.sampling_params",
    "RequestOutputKind": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "GuidedDecodingParams": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "TokensPrompt": "pagedllm.inputs",
    "TextPrompt": "pagedllm.inputs",
    "LoRARequest": "pagedllm.lora.request",
    "PoolingParams": "pagedllm.pooling_params",
    "PoolingRequestOutput": "pagedllm.outputs",
    "EmbeddingRequestOutput": "pagedllm.outputs",
    "ClassificationRequestOutput": "pagedllm.outputs",
    "ScoringRequestOutput": "pagedllm.outputs",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")


if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.inputs import TextPrompt, TokensPrompt
    from pagedllm.lora.request import LoRARequest
    from pagedllm.outputs import (ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput, Logprob,
                                  PoolingRequestOutput, RequestOutput, ScoringRequestOutput)
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import (GuidedDecodingParams, RequestOutputKind, SamplingParams,
                                          StructuredOutputsParams)
