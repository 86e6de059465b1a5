"""LLM: the offline API — vLLM's `LLM.generate` / `LLM.chat` contract."""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.chat_utils import ChatMessage, apply_chat_template
from pagedllm.entrypoints.score_utils import pair_prompts
from pagedllm.inputs import PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import (
    ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
    ScoringOutput, ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.utils import check_profiling_on, fewer_full_collections


class LLM:
    """An engine for offline batched generation.

    ``LLM(model, **kwargs)`` takes every EngineArgs field by name (vLLM's names), so a
    framework can pass its config dict straight through; unknown keys raise TypeError.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("disable_log_stats", True)  # the progress bar reports throughput
        engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args, usage_context="llm_class")
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults of the model's generation_config (vLLM's rule)."""
        return self.llm_engine.get_default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    # ---- RL rollout: sleep mode and weight updates (vLLM's contract) ------------------------
    def sleep(self, level: int = 1) -> None:
        """Free GPU memory for a trainer: level 1 frees the KV cache and moves the weights to
        (pinned) host memory; level 2 frees both (a weight update must follow wake_up). Needs
        enable_sleep_mode=True and no request in flight; requests are refused until wake_up."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed: all (None), or ["weights"] then ["kv_cache"] so that a
        weight update can run before the KV cache takes its memory back."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def start_profile(self) -> None:
        """Start torch.profiler in every worker (vLLM's call; PAGEDLLM_TORCH_PROFILER_DIR names
        the folder and must be set before the engine starts)."""
        check_profiling_on()
        self.collective_rpc("start_profile")

    def stop_profile(self) -> list[str | None]:
        """Stop it; each worker writes ``rank{N}.trace.json`` and ``rank{N}.txt`` (wall time,
        device busy time, ops by their own time). Returns the summaries' paths, in rank order
        (None for a rank where no session ran)."""
        check_profiling_on()
        return self.collective_rpc("stop_profile")

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run a Worker method (by name, e.g. "load_weights") or ``method(worker, *args, **kwargs)``
        on every worker; returns one result per worker. "load_weights" also resets the prefix cache."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load ``(name, tensor)`` pairs in the Hugging Face checkpoint's names (q/k/v and gate/up
        fused here) into the running model, then reset the prefix cache. Tensors may be on any
        device and in any float dtype; they are copied and cast into place."""
        self.collective_rpc("load_weights", args=(named_tensors,))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self.llm_engine.pin_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order. ``lora_request``: one
        adapter for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompts)} prompts"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries but there are {len(prompts)} prompts")
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != len(prompts):
                raise ValueError(f"lora_request has {len(lora_request)} entries but there are {len(prompts)} prompts")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(prompts)
        return self._run(prompts, params_list, priority or [0] * len(prompts), use_tqdm, loras)

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate.
        `chat_template_content_format` (auto/string/openai) is vLLM's: how message content
        reaches the template; `tools` (OpenAI tool definitions) go to the template as vLLM's do."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = messages if isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        prompts = [
            {"prompt_token_ids": apply_chat_template(
                tokenizer, conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, content_format=chat_template_content_format,
                **(chat_template_kwargs or {}), **({"tools": tools} if tools else {}))}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams], priority: list[int],
             use_tqdm: bool, loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, params, prio, lora in zip(prompts, params_list, priority, loras or [None] * len(prompts)):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._counter))
                engine.add_request(request_id, prompt, params, priority=prio, lora_request=lora)
                ids.append(request_id)
            results: dict[str, RequestOutput] = {}
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
            start = time.perf_counter()
            in_tokens = out_tokens = 0
            with fewer_full_collections():  # each would stall the device (utils.rare_full_collections)
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            in_tokens += len(out.prompt_token_ids)
                            out_tokens += sum(len(o.token_ids) for o in out.outputs)
                            elapsed = time.perf_counter() - start
                            bar.set_postfix_str(f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                                f"output: {out_tokens / elapsed:.2f} toks/s", refresh=False)
                            bar.update(1)
            bar.close()
        except BaseException:
            engine.abort_request(ids)  # leave the engine clean for the next call
            raise
        return [results[i] for i in ids]

    # ---- pooling models (vLLM's embed / classify / score / reward / encode) ----------------------
    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None, pooling_task: str | None = None,
               ) -> list[PoolingRequestOutput]:
        """The pooled outputs of a pooling model, one per prompt, in input order (``data``: a
        float32 tensor). ``pooling_task`` (embed, classify, score, reward, encode) sets the task of
        params that name none; None: "encode", the pooled hidden states as they are."""
        prompts = self._prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        params_list = [pooling_params] * len(prompts) if isinstance(pooling_params, PoolingParams) \
            else list(pooling_params)
        if len(params_list) != len(prompts):
            raise ValueError(f"pooling_params has {len(params_list)} entries but there are {len(prompts)} prompts")
        task = pooling_task or "encode"
        prompts = self._tokenize_texts(prompts)
        resolved = []
        for p in params_list:
            if not isinstance(p, PoolingParams):
                raise ValueError(f"pooling_params must be PoolingParams, got {type(p).__name__}")
            p = p.clone()
            p.task = p.task or task
            if truncate_prompt_tokens is not None:
                p.truncate_prompt_tokens = truncate_prompt_tokens
            resolved.append(p)
        return self._run_pooling(prompts, resolved, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None, *,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``)."""
        out = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens,
                          pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in out]

    def classify(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None, *,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``outputs.probs``)."""
        out = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens,
                          pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in out]

    def reward(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None, *,
               use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """A reward model's scores (per token with ALL pooling)."""
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens,
                           pooling_task="reward")

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None, pooling_params: PoolingParams | None = None,
              ) -> list[ScoringRequestOutput]:
        """Relevance of each (data_1, data_2) pair: 1:1, 1:N (one query, N documents) or N:N.
        A cross-encoder (a classification model with one label) scores the pair as one input; an
        embedding model gives the cosine similarity of the two embeddings."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if not first or not second:
            raise ValueError("score needs at least one text on each side")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValueError(f"score pairs 1:1, 1:N or N:N; got {len(first)} and {len(second)} texts")
        if not all(isinstance(t, str) for t in first + second):
            raise ValueError("score takes texts (strings)")
        if self.llm_engine.model_config.pooling_kind == "embed":
            return self._cosine_scores(first, second, use_tqdm, truncate_prompt_tokens, pooling_params)
        prompts = pair_prompts(self.get_tokenizer(), first, second, truncation=truncate_prompt_tokens is not None,
                               max_length=truncate_prompt_tokens if truncate_prompt_tokens not in (None, -1) else None)
        out = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="score")
        return [ScoringRequestOutput.from_base(o) for o in out]

    def _cosine_scores(self, first: list[str], second: list[str], use_tqdm: bool, truncate: int | None,
                       pooling_params: PoolingParams | None) -> list[ScoringRequestOutput]:
        import torch

        texts = list(dict.fromkeys(first + second))
        params = (pooling_params or PoolingParams()).clone()
        params.use_activation = True  # cosine of normalised vectors
        embedded = dict(zip(texts, self.encode(texts, params, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate,
                                               pooling_task="embed")))
        out = []
        for i, (a, b) in enumerate(zip(first, second)):
            ea, eb = embedded[a], embedded[b]
            score = float(torch.nn.functional.cosine_similarity(ea.outputs.data, eb.outputs.data, dim=0))
            out.append(ScoringRequestOutput(f"score-{i}", ScoringOutput(score),
                                            ea.prompt_token_ids + eb.prompt_token_ids, True))
        return out

    def _tokenize_texts(self, prompts: list) -> list:
        """Text prompts tokenized in one batch call (the fast tokenizers encode a batch on
        several threads), as TokensPrompts keeping their text."""
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str) and p]
        tokenizer = self.get_tokenizer()
        if len(texts) < 2 or tokenizer is None or not getattr(tokenizer, "is_fast", False):
            return prompts
        ids = tokenizer([prompts[i] for i in texts])["input_ids"]
        out = list(prompts)
        for i, token_ids in zip(texts, ids):
            out[i] = {"prompt": prompts[i], "prompt_token_ids": token_ids}
        return out

    @staticmethod
    def _prompt_list(prompts) -> list:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def _run_pooling(self, prompts: list[PromptType], params_list: list[PoolingParams], use_tqdm: bool
                     ) -> list[PoolingRequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._counter))
                engine.add_request(request_id, prompt, params)
                ids.append(request_id)
            results: dict[str, PoolingRequestOutput] = {}
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
            start, in_tokens = time.perf_counter(), 0
            with fewer_full_collections():
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            in_tokens += len(out.prompt_token_ids)
                            bar.set_postfix_str(f"est. speed input: {in_tokens / (time.perf_counter() - start):.2f} "
                                                "toks/s", refresh=False)
                            bar.update(1)
            bar.close()
        except BaseException:
            engine.abort_request(ids)
            raise
        return [results[i] for i in ids]
