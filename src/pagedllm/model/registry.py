"""Which model class serves which HF ``architectures`` name."""
from __future__ import annotations

from torch import nn

from pagedllm.model.bert import (
    BertForSequenceClassification, BertModel, XLMRobertaForSequenceClassification, XLMRobertaModel,
)
from pagedllm.model.mixtral import MixtralForCausalLM
from pagedllm.model.olmo import Olmo2ForCausalLM, OlmoForCausalLM
from pagedllm.model.pooling_models import as_pooling_model
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

# Pooling models by architecture name: encoders, decoder bodies as sentence-transformers saves
# them, and sequence-classification heads on decoder bodies.
POOLING_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "XLMRobertaModel": XLMRobertaModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "LlamaModel": as_pooling_model(LlamaForCausalLM, "embed", bare=True),
    "MistralModel": as_pooling_model(MistralForCausalLM, "embed", bare=True),
    "Qwen2Model": as_pooling_model(Qwen2ForCausalLM, "embed", bare=True),
    "Qwen3Model": as_pooling_model(Qwen3ForCausalLM, "embed", bare=True),
    "LlamaForSequenceClassification": as_pooling_model(LlamaForCausalLM, "classify"),
    "MistralForSequenceClassification": as_pooling_model(MistralForCausalLM, "classify"),
    "Qwen2ForSequenceClassification": as_pooling_model(Qwen2ForCausalLM, "classify"),
    "Qwen3ForSequenceClassification": as_pooling_model(Qwen3ForCausalLM, "classify"),
}
ENCODER_ARCHITECTURES = {"BertModel", "XLMRobertaModel", "BertForSequenceClassification",
                         "XLMRobertaForSequenceClassification"}

# Vision-language checkpoints served as their text model: the loader swaps in ``text_config``.
TEXT_MODEL_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration"}


def get_model_class(architectures: list[str] | None, convert: str = "none") -> type[nn.Module]:
    """The class for the first supported name in a config's ``architectures``; ``convert``
    ("embed" | "classify" | "reward") turns a generative one into a pooling model."""
    for name in architectures or []:
        if name in POOLING_ARCHITECTURES:
            return POOLING_ARCHITECTURES[name]
        if name in SUPPORTED_ARCHITECTURES:
            cls = SUPPORTED_ARCHITECTURES[name]
            return cls if convert == "none" else as_pooling_model(cls, convert)
    raise ValueError(
        f"model architecture(s) {list(architectures or [])} are not supported; "
        f"supported architectures: {sorted(SUPPORTED_ARCHITECTURES) + sorted(POOLING_ARCHITECTURES)}"
    )
