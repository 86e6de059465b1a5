"""The second network of speculative decoding (a draft model, an EAGLE head): its config, checked
against the target's at the engine-args boundary."""
from __future__ import annotations

import dataclasses

from pagedllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
from pagedllm.core.kv_cache_groups import make_kv_cache_groups

# EAGLE-1 heads are Llama decoder layers reading the target's embedding, final-normed hidden
# states and LM head: targets of that shape (no embedding scale, one such table and head).
EAGLE_TARGET_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def draft_model_config(spec: SpeculativeConfig | None, target: ModelConfig, parallel: ParallelConfig,
                       trust_remote_code: bool) -> ModelConfig | None:
    """The draft (method draft_model: the target's vocabulary) or the EAGLE head (method eagle:
    the target's hidden size) as a ModelConfig beside the target's; None for other methods."""
    if spec is None or spec.method not in ("draft_model", "eagle"):
        return None
    groups = make_kv_cache_groups(target.layer_sliding_windows or [None])
    if len(groups) > 1:
        raise ValueError(f"speculative_config method {spec.method!r} is not supported for {target.architecture}: its "
                         f"layers form {len(groups)} KV cache groups (sliding-window and full attention), and the "
                         "draft's cache follows a single block table; use method 'ngram'")
    from pagedllm.model.loader import resolve_model

    if spec.draft_tensor_parallel_size not in (None, parallel.tensor_parallel_size):
        raise ValueError(f"speculative_config draft_tensor_parallel_size must be None or the target's "
                         f"tensor_parallel_size ({parallel.tensor_parallel_size}), got "
                         f"{spec.draft_tensor_parallel_size}")
    resolved = resolve_model(spec.model, trust_remote_code=trust_remote_code)
    if spec.method == "eagle":
        _check_eagle(spec, target, parallel, resolved.hf_config)
        return dataclasses.replace(target, model=spec.model, path=resolved.path, gguf_file=None,
                                   hf_config=resolved.hf_config, quantization=None)
    if resolved.hf_config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model {spec.model!r} has a vocabulary of "
                         f"{resolved.hf_config.vocab_size} tokens, the target {target.vocab_size}: a draft must "
                         "share the target's tokenizer")
    from pagedllm.model.quantization import resolve_quantization

    return dataclasses.replace(target, model=spec.model, path=resolved.path, gguf_file=resolved.gguf_file,
                               hf_config=resolved.hf_config,
                               quantization=resolve_quantization(resolved.hf_config, None))


def _check_eagle(spec: SpeculativeConfig, target: ModelConfig, parallel: ParallelConfig, head_config) -> None:
    archs = list(getattr(target.hf_config, "architectures", None) or [])
    if not archs or archs[0] not in EAGLE_TARGET_ARCHITECTURES:
        raise ValueError(f"speculative_config method 'eagle' needs a target of architecture "
                         f"{list(EAGLE_TARGET_ARCHITECTURES)}, the target is {archs}")
    if target.runner_type != "generate" or target.gguf_file is not None:
        raise ValueError("speculative_config method 'eagle' needs a generative target loaded from safetensors "
                         "(the head reads its hidden states, embedding and LM head)")
    if parallel.tensor_parallel_size != 1:
        raise ValueError(f"speculative_config method 'eagle' runs with tensor_parallel_size=1 only, got "
                         f"{parallel.tensor_parallel_size}")
    head, want = getattr(head_config, "hidden_size", None), target.hf_config.hidden_size
    if head != want:
        raise ValueError(f"speculative_config model {spec.model!r}: the EAGLE head's hidden_size is {head}, the "
                         f"target's {want}; a head is trained for one target")
    head_len = getattr(head_config, "max_position_embeddings", None)
    if head_len is not None and head_len < target.max_model_len:
        raise ValueError(f"speculative_config model {spec.model!r}: the EAGLE head's max_position_embeddings "
                         f"({head_len}) is below max_model_len={target.max_model_len}; lower max_model_len")
