"""Which method a mixture of experts' routed experts (``model.moe.FusedMoE``) run under a
quantization config: fp8 experts (``fp8_moe.py``) for fp8 and compressed-tensors fp8 configs, int4
experts (``int4_moe.py``) for AWQ, GPTQ and compressed-tensors W4A16; any other config is refused
by name. The configs only say whether they can (``experts_supported``), so they import no
expert code."""
from __future__ import annotations

from torch import nn

from pagedllm.model.quantization.base import QuantizationConfig, experts_unsupported, matches_ignore
from pagedllm.model.quantization.fp8 import Fp8BlockLinearMethod, Fp8Config, Fp8LinearMethod
from pagedllm.model.quantization.fp8_moe import Fp8MoEMethod
from pagedllm.model.quantization.int4 import Int4LinearMethod
from pagedllm.model.quantization.int4_moe import Int4MoEMethod


def experts_method(config: QuantizationConfig, moe: nn.Module, prefix: str, model_name: str):
    """The method of the routed experts ``prefix`` (None: they stay dense, as an ignore list says)."""
    if not config.experts_supported:
        raise experts_unsupported(config.name, model_name)
    if isinstance(config, Fp8Config):
        if matches_ignore([prefix], config.ignored, substring=True):
            return None
        return Fp8MoEMethod(config.serialized, config.block)
    # The method the config gives expert 0's projections (its ignore lists and groups decide).
    prefixes = [f"{prefix}.0.gate_proj", f"{prefix}.0.up_proj", f"{prefix}.0.down_proj"]
    method = config.method_for(moe, prefix, prefixes)
    if isinstance(method, Fp8BlockLinearMethod):
        return Fp8MoEMethod(serialized=True, block=method.block)
    if isinstance(method, Fp8LinearMethod):
        return Fp8MoEMethod(serialized=True)
    if isinstance(method, Int4LinearMethod):
        return Int4MoEMethod(lambda: config.method_for(moe, prefix, prefixes))
    if method is None:
        return None
    raise experts_unsupported(config.name, model_name)
