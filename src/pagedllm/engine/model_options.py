"""Engine args that depend on the model: its weight quantization, and routed experts (MoE)."""
from __future__ import annotations

from typing import Any


def model_quantization(args: Any, resolved: Any) -> str | None:
    """The weight quantization the model runs; what cannot compose with it is refused here."""
    from pagedllm.model.quantization import get_quantization_config, resolve_quantization

    method = resolve_quantization(resolved.hf_config, args.quantization)
    if method is None:
        return None
    gguf = resolved.gguf_file is not None or args.load_format == "gguf"
    if gguf != (method == "gguf"):
        raise ValueError(f"quantization={method!r} with {'GGUF' if gguf else 'these'} weights: GGUF weights run "
                         "quantized with quantization='gguf' only (without it they are dequantized at load), and "
                         "only GGUF weights do")
    # A config we cannot run fails here, not in a worker.
    config = None if gguf else get_quantization_config(method, resolved.hf_config)
    if num_experts_of(resolved.hf_config) is not None and not getattr(config, "experts_supported", False):
        from pagedllm.model.quantization.base import experts_unsupported

        raise experts_unsupported(method, (getattr(resolved.hf_config, "architectures", None) or ["this model"])[0])
    return method

def routed_experts_option(args: Any, hf_config: Any) -> bool:
    if not args.enable_return_routed_experts:
        return False
    if num_experts_of(hf_config) is None:
        raise ValueError("enable_return_routed_experts needs a mixture-of-experts model; "
                         f"{(getattr(hf_config, 'architectures', None) or ['this model'])[0]} has no experts")
    if args.pipeline_parallel_size > 1:
        raise ValueError("enable_return_routed_experts cannot be combined with pipeline_parallel_size > 1 "
                         "(the last stage, which reports outputs, does not see the other stages' layers)")
    if args._speculative_config() is not None:
        raise ValueError("enable_return_routed_experts cannot be combined with speculative decoding yet "
                         "(rejected draft positions would need their routing rolled back)")
    return True


def num_experts_of(hf_config: Any) -> int | None:
    """Routed experts per MoE layer, by the names the MoE configs use (None: a dense model)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None
