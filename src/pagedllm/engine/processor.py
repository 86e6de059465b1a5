"""Processor: user prompt + SamplingParams → a validated EngineCoreRequest."""
from __future__ import annotations

import time
from typing import Any

from pagedllm.config import LoRAConfig, ModelConfig, StructuredOutputsConfig
from pagedllm.core.messages import EngineCoreRequest
from pagedllm.inputs import PromptType
from pagedllm.sampling_params import SamplingParams


class Processor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any | None,
                 structured_config: StructuredOutputsConfig | None = None,
                 lora_config: LoRAConfig | None = None) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        self._lora_paths: dict[int, str] = {}  # adapters checked so far: id -> path
        self.tokenizer = tokenizer
        self.structured_config = structured_config or StructuredOutputsConfig()
        self.generation_eos_ids = model_config.generation_eos_token_ids()
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        if eos is None:
            eos = getattr(model_config.hf_config, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, list) else eos
        self.eos_token_id: int | None = eos

    def parse_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids)."""
        if isinstance(prompt, str):
            return prompt, self._tokenize(prompt, add_special_tokens)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self._tokenize(prompt["prompt"], add_special_tokens)
            raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string, a TextPrompt, a TokensPrompt or a list of token ids, got {type(prompt).__name__}"
        )

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; with skip_tokenizer_init=True pass TokensPrompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams,
        arrival_time: float | None = None, priority: int = 0, lora_request: Any = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if self.model_config.runner_type == "pooling":
            raise ValueError(f"{self.model_config.architecture} is served as a pooling model: it does not generate "
                             "(use embed / classify / score / encode)")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        mc = self.model_config
        if lora_request is not None:
            self.check_lora(lora_request)
        text, token_ids = self.parse_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = mc.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(token_ids)}..{max(token_ids)}")
        if len(token_ids) >= mc.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, which leaves no room to generate within "
                f"max_model_len={mc.max_model_len}; shorten it or use truncate_prompt_tokens"
            )
        params.verify_for_model(vocab, mc.max_logprobs)
        if self.tokenizer is None and params.detokenize:
            raise ValueError("detokenize=True needs a tokenizer; with skip_tokenizer_init=True set detokenize=False")
        params = params.clone()
        if params.structured_outputs is not None:
            self._check_structured_outputs(params)
        params.update_from_generation_config(self.generation_eos_ids)
        params.update_from_tokenizer(self.tokenizer)
        eos = None if params.ignore_eos else self.eos_token_id
        if params.max_tokens is None:
            params.max_tokens = mc.max_model_len - len(token_ids)
        return text, EngineCoreRequest(request_id, token_ids, params, eos, arrival_time or time.time(), priority,
                                       lora_request)

    def process_pooling(self, request_id: str, prompt: PromptType, params: Any, arrival_time: float | None = None,
                        priority: int = 0) -> tuple[str | None, EngineCoreRequest]:
        """A pooling request: its prompt (optionally truncated, whole within max_model_len) and
        params checked against the model's pooler; it emits no token."""
        from pagedllm.pooling_params import PoolingParams

        mc = self.model_config
        if mc.runner_type != "pooling":
            raise ValueError(f"{mc.architecture} is a generative model: embed / classify / score / encode need a "
                             "pooling model (runner='pooling', or convert='embed' for a decoder body)")
        if not isinstance(params, PoolingParams):
            raise ValueError(f"params must be PoolingParams, got {type(params).__name__}")
        params = params.clone()
        self._check_pooling(params)
        token_types = None
        if isinstance(prompt, dict) and "token_type_ids" in prompt:
            token_types = list(prompt["token_type_ids"])
            prompt = {k: v for k, v in prompt.items() if k != "token_type_ids"}
        text, token_ids = self.parse_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = mc.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if keep > mc.max_model_len:
                raise ValueError(f"truncate_prompt_tokens={keep} is more than max_model_len={mc.max_model_len}")
            token_ids = token_ids[-keep:]
            token_types = token_types[-keep:] if token_types else None
        if not token_ids:
            raise ValueError("the input is empty: at least one token is needed")
        vocab = mc.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"input token ids must be in [0, {vocab}), got {min(token_ids)}..{max(token_ids)}")
        if len(token_ids) > mc.max_model_len:
            raise ValueError(f"the input has {len(token_ids)} tokens, more than max_model_len={mc.max_model_len}; "
                             "shorten it or set truncate_prompt_tokens")
        if token_types:
            if len(token_types) != len(token_ids) or not all(t in (0, 1) for t in token_types):
                raise ValueError("token_type_ids must hold 0 or 1 for every input token")
            params.extra_kwargs["token_type_ids"] = token_types
        carrier = SamplingParams(max_tokens=1, detokenize=False)
        return text, EngineCoreRequest(request_id, token_ids, carrier, None, arrival_time or time.time(), priority,
                                       None, pooling_params=params)

    def _check_pooling(self, params: Any) -> None:
        from pagedllm.model.pooler import TASKS

        mc = self.model_config
        kind = mc.pooling_kind
        if params.task is None:
            params.task = "embed" if kind == "embed" else "classify" if kind == "classify" else "reward"
        if params.task not in TASKS[kind]:
            raise ValueError(f"task {params.task!r} does not apply to this {kind} model; it serves "
                             f"{list(TASKS[kind])}")
        if params.dimensions is not None:
            if params.task != "embed":
                raise ValueError("dimensions applies to embeddings only")
            allowed = mc.pooler_config.matryoshka_dimensions
            if not allowed:
                raise ValueError(f"dimensions: model {mc.model!r} does not support matryoshka representation "
                                 "(it gives only its full size)")
            if params.dimensions not in allowed:
                raise ValueError(f"dimensions={params.dimensions} is not one of the model's {allowed}")

    def check_lora(self, lora_request: Any, replace: bool = False) -> None:
        """An adapter is read and checked against the model once, before its first request is
        queued: a bad one fails here, the engine never sees it. ``replace`` (``add_lora``): an
        adapter in memory may take over its id (a trainer's new weights)."""
        from pagedllm.lora.peft_loader import load_adapter
        from pagedllm.lora.request import LoRARequest

        if self.lora_config is None:
            raise ValueError("lora_request needs an engine created with enable_lora=True")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        lora_id = lora_request.lora_int_id
        known = self._lora_paths.get(lora_id)
        if not lora_request.has_source:
            if known is None:
                raise ValueError(f"lora_int_id {lora_id} is not a known adapter: give lora_path, or add it first "
                                 "with add_lora")
            return
        source = lora_request.lora_path or "<tensors>"
        if known == source and lora_request.tensors is None:
            return
        if known is not None and not (replace and lora_request.tensors is not None):
            raise ValueError(f"lora_int_id {lora_id} already names the adapter at {known!r}; give another adapter "
                             "another id (or remove_lora it first)")
        load_adapter(lora_request, self.model_config.hf_config, self.lora_config.max_lora_rank)
        self._lora_paths[lora_id] = source

    def knows_lora(self, lora_id: int) -> bool:
        return lora_id in self._lora_paths

    def forget_lora(self, lora_id: int) -> None:
        self._lora_paths.pop(lora_id, None)

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """Limits, then which backend takes the constraint (checked without the tokenizer, cheaply:
        an invalid or unsupported one is refused here, naming its field). The compile itself runs
        in the engine core, off its loop."""
        from pagedllm.structured_output.backends import choose_backend

        so, cfg = params.structured_outputs, self.structured_config
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init=True has none)")
        so.check_limits(cfg.max_spec_bytes, cfg.max_nesting_depth)
        backend = getattr(so, "backend", None) or cfg.backend  # GuidedDecodingParams may name one
        so._backend = choose_backend(so, backend, cfg.disable_fallback)
