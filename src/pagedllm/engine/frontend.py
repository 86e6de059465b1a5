"""What every engine front end holds: tokenizer, processor, output processor, parents."""
from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest
from pagedllm.engine.processor import Processor
from pagedllm.sampling_params import SamplingParams


class EngineFrontend:
    """Shared by LLMEngine (core in-process) and AsyncLLM (core in its own process)."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.tokenizer import get_tokenizer

        self.config = config
        self.model_config = config.model_config
        self.tokenizer = None if config.model_config.skip_tokenizer_init else get_tokenizer(config.model_config)
        self.processor = Processor(config.model_config, self.tokenizer, config.structured_outputs_config,
                                   config.lora_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.parents: dict[str, ParentRequest] = {}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: str | None = None):
        return cls(engine_args.create_engine_config(usage_context))

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("the tokenizer was not initialized (skip_tokenizer_init=True)")
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults of the model's generation_config (vLLM's rule)."""
        return SamplingParams(**self.model_config.default_sampling_overrides())
