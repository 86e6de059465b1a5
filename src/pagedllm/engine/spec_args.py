"""The second network of speculative decoding (a draft model, an EAGLE head): its config, checked
against the target's at the engine-args boundary."""
from __future__ import annotations

import dataclasses

from pagedllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
from pagedllm.core.kv_cache_groups import make_kv_cache_groups

# EAGLE heads are Llama decoder layers reading the target's embedding and hidden states (EAGLE-1:
# final-normed, and its LM head; EAGLE-3: three residual streams of model/llama.py's LlamaModel):
# targets of that shape (no embedding scale, one such table and head).
EAGLE_TARGET_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def draft_model_config(spec: SpeculativeConfig | None, target: ModelConfig, parallel: ParallelConfig,
                       trust_remote_code: bool) -> ModelConfig | None:
    """The draft (method draft_model: the target's vocabulary) or the EAGLE head (methods eagle,
    eagle3: trained for the target) as a ModelConfig beside the target's; None for other methods."""
    if spec is None or spec.method not in ("draft_model", "eagle", "eagle3"):
        return None
    groups = make_kv_cache_groups(target.layer_sliding_windows or [None])
    if len(groups) > 1:
        raise ValueError(f"speculative_config method {spec.method!r} is not supported for {target.architecture}: its "
                         f"layers form {len(groups)} KV cache groups (sliding-window and full attention), and the "
                         "draft's cache follows a single block table; use method 'ngram'")
    from pagedllm.model.loader import resolve_model

    if spec.draft_tensor_parallel_size not in (None, 1, parallel.tensor_parallel_size):
        raise ValueError(f"speculative_config draft_tensor_parallel_size must be None, 1 (the draft whole on every "
                         f"rank) or the target's tensor_parallel_size ({parallel.tensor_parallel_size}), got "
                         f"{spec.draft_tensor_parallel_size}")
    resolved = resolve_model(spec.model, trust_remote_code=trust_remote_code)
    if spec.method in ("eagle", "eagle3"):
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
    method = spec.method
    archs = list(getattr(target.hf_config, "architectures", None) or [])
    if not archs or archs[0] not in EAGLE_TARGET_ARCHITECTURES:
        raise ValueError(f"speculative_config method {method!r} needs a target of architecture "
                         f"{list(EAGLE_TARGET_ARCHITECTURES)}, the target is {archs}")
    if target.runner_type != "generate" or target.gguf_file is not None:
        raise ValueError(f"speculative_config method {method!r} needs a generative target loaded from safetensors "
                         "(the head reads its hidden states, embedding and LM head)")
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(parallel, key) != 1:
            raise ValueError(f"speculative_config method {method!r} runs with {key}=1 only, got "
                             f"{getattr(parallel, key)}")
    if method == "eagle3":
        _check_eagle3(spec, target, head_config)
        return
    head, want = getattr(head_config, "hidden_size", None), target.hf_config.hidden_size
    if head != want:
        raise ValueError(f"speculative_config model {spec.model!r}: the EAGLE head's hidden_size is {head}, the "
                         f"target's {want}; a head is trained for one target")
    head_len = getattr(head_config, "max_position_embeddings", None)
    if head_len is not None and head_len < target.max_model_len:
        raise ValueError(f"speculative_config model {spec.model!r}: the EAGLE head's max_position_embeddings "
                         f"({head_len}) is below max_model_len={target.max_model_len}; lower max_model_len")


def _check_eagle3(spec: SpeculativeConfig, target: ModelConfig, head_config) -> None:
    from pagedllm.model.eagle3 import aux_layer_ids, draft_vocab_size, target_hidden_size

    name, tc = spec.model, target.hf_config
    if (getattr(head_config, "eagle_config", None) or {}).get("use_aux_hidden_state", True) is False:
        raise ValueError(f"speculative_config model {spec.model!r}: eagle_config use_aux_hidden_state=False "
                         "(a head without the fc fusion of the target's hidden states) is not supported")
    if target_hidden_size(head_config) != tc.hidden_size:
        raise ValueError(f"speculative_config model {name!r}: the EAGLE-3 head's target_hidden_size (or "
                         f"hidden_size) is {target_hidden_size(head_config)}, the target's hidden_size "
                         f"{tc.hidden_size}; a head is trained for one target")
    if getattr(head_config, "vocab_size", None) != tc.vocab_size:
        raise ValueError(f"speculative_config model {name!r}: the EAGLE-3 head's vocab_size is "
                         f"{getattr(head_config, 'vocab_size', None)}, the target's {tc.vocab_size}")
    draft_vocab = draft_vocab_size(head_config)
    if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= tc.vocab_size:
        raise ValueError(f"speculative_config model {name!r}: the EAGLE-3 head's draft_vocab_size must be in "
                         f"[1, {tc.vocab_size}] (the target's vocab_size), got {draft_vocab!r}")
    layers = tc.num_hidden_layers
    ids = aux_layer_ids(head_config, layers)
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i < layers for i in ids):
        raise ValueError(f"speculative_config model {name!r}: eagle_aux_hidden_state_layer_ids must be 3 "
                         f"distinct target layers in [0, {layers}), got {ids} (the default, when the head "
                         f"config has none, is [2, num_hidden_layers // 2, num_hidden_layers - 3])")
    # No max_position_embeddings check: the head's rotary table reaches max_model_len (model/eagle3.py).
