"""Which model class serves which HF ``architectures`` name."""
from __future__ import annotations

from torch import nn

from pagedllm.model.mixtral import MixtralForCausalLM
from pagedllm.model.olmo import Olmo2ForCausalLM, OlmoForCausalLM
from pagedllm.model.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pagedllm.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from pagedllm.model.llama import (
    LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
)

SUPPORTED_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "OlmoForCausalLM": OlmoForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}

# Vision-language checkpoints served as their text model: the loader swaps in ``text_config``.
TEXT_MODEL_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration"}


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first supported name in a config's ``architectures``."""
    for name in architectures or []:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    raise ValueError(
        f"model architecture(s) {list(architectures or [])} are not supported; "
        f"supported architectures: {sorted(SUPPORTED_ARCHITECTURES)}"
    )
