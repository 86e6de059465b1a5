"""Which model class serves which HF ``architectures`` name."""
from __future__ import annotations

from torch import nn

from pagedllm.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

SUPPORTED_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first supported name in a config's ``architectures``."""
    for name in architectures or []:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    raise ValueError(
        f"model architecture(s) {list(architectures or [])} are not supported; "
        f"supported architectures: {sorted(SUPPORTED_ARCHITECTURES)}"
    )
