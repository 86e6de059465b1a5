"""Engine args of pooling models: the runner they get and what they cannot combine with."""
from __future__ import annotations

from typing import Any


def pooling_setup(args: Any, resolved: Any) -> tuple[str, str, Any, bool, str | None]:
    """(runner, convert, pooler config, is_encoder); refuses what pooling models cannot combine with."""
    from pagedllm.model.pooling_setup import resolve_pooling

    if args.pooler_config is not None and args.override_pooler_config is not None:
        raise ValueError("give pooler_config or its older name override_pooler_config, not both")
    runner, convert, pooler, is_encoder, kind = resolve_pooling(
        resolved.hf_config, resolved.path, args.runner, args.convert, args.task,
        args.pooler_config if args.pooler_config is not None else args.override_pooler_config)
    if runner != "pooling":
        return runner, convert, pooler, is_encoder, kind
    for name, value in (("speculative_config", args.speculative_config or args.speculative_model),
                        ("enable_lora", args.enable_lora), ("async_scheduling", args.async_scheduling),
                        ("enable_return_routed_experts", args.enable_return_routed_experts)):
        if value:
            raise ValueError(f"{name} does not apply to pooling models (runner='pooling'): they only prefill")
    if is_encoder and args.pipeline_parallel_size > 1:
        raise ValueError("pipeline_parallel_size > 1 is not supported for encoder models")
    if is_encoder and args.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={args.kv_cache_dtype!r} does not apply to encoder models: their "
                         "bidirectional attention sees each prompt whole and reads no KV cache (leave it 'auto')")
    tokens = getattr(resolved.hf_config, "classifier_from_token", None)
    if tokens:  # Qwen3-Reranker: the two tokens' ids, read with the model's tokenizer
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer or resolved.path,
                                            trust_remote_code=args.trust_remote_code)
        ids = [tok.convert_tokens_to_ids(t) for t in tokens]
        if any(i is None or i == tok.unk_token_id for i in ids):
            raise ValueError(f"classifier_from_token {tokens!r}: not tokens of the model's vocabulary")
        resolved.hf_config._classifier_token_ids = ids
    return runner, convert, pooler, is_encoder, kind

def prefix_caching(enable_prefix_caching: bool | None, pooler: Any, is_encoder: bool) -> bool:
    """On by default; pooling that reads every prompt token (MEAN, CLS, ALL, STEP) or an
    encoder's bidirectional states cannot reuse cached prefixes, so it is off there."""
    reuses = pooler is None or (not is_encoder and pooler.pooling_type == "LAST")
    if enable_prefix_caching and not reuses:
        raise ValueError(f"enable_prefix_caching=True does not apply to {'an encoder' if is_encoder else ''}"
                         f"{'' if is_encoder else pooler.pooling_type + ' pooling'}: every prompt token's state "
                         "is needed")
    return reuses if enable_prefix_caching is None else enable_prefix_caching
