"""Model definitions, their layers, the architecture registry and weight loading."""
from pagedllm.model.loader import ResolvedModel, iterate_weights, load_model, resolve_model
from pagedllm.model.registry import SUPPORTED_ARCHITECTURES, get_model_class

__all__ = [
    "ResolvedModel", "SUPPORTED_ARCHITECTURES", "get_model_class", "iterate_weights", "load_model", "resolve_model",
]
