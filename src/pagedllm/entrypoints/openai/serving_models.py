"""The models a server answers for: the base model's served names and its LoRA adapters
(``--lora-modules``, or loaded at runtime), each adapter a ``model`` clients can pick."""
from __future__ import annotations

import itertools
import json
from typing import Any, Optional

from pagedllm.entrypoints.openai.protocol import BadParam, ModelCard
from pagedllm.lora.request import LoRARequest


def parse_lora_module(text: str) -> dict[str, Any]:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules entry is not valid JSON: {e}") from None
        if not isinstance(spec, dict) or not spec.get("name") or not spec.get("path"):
            raise ValueError(f"--lora-modules JSON entries need 'name' and 'path', got {text[:100]!r}")
        return spec
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules entries are name=path or JSON, got {text[:100]!r}")
    return {"name": name, "path": path}


class ServingModels:
    def __init__(self, engine: Any, served_model_names: list[str], lora_modules: Optional[list[str]] = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        for text in lora_modules or []:
            spec = parse_lora_module(text)
            self.load(spec["name"], spec["path"], spec.get("base_model_name"))

    def load(self, name: str, path: str, base_model_name: Optional[str] = None) -> LoRARequest:
        """Check the adapter now (a bad one is refused here) and answer for ``name``."""
        if name in self.loras or name in self.served_model_names:
            raise BadParam("lora_name", f"the model name {name!r} is already in use")
        request = LoRARequest(name, next(self._ids), path, base_model_name)
        self.engine.processor.check_lora(request)
        self.loras[name] = request
        return request

    def unload(self, name: str) -> None:
        request = self.loras.pop(name, None)
        if request is None:
            raise BadParam("lora_name", f"no LoRA adapter is loaded under the name {name!r}")
        self.engine.processor.forget_lora(request.lora_int_id)

    def resolve(self, requested: Optional[str]) -> tuple[str, Optional[LoRARequest]]:
        """The model name a reply carries and the adapter it runs (None: the base model)."""
        if requested is None:
            return self.served_model_names[0], None
        if requested in self.loras:
            return requested, self.loras[requested]
        if requested in self.served_model_names:
            return requested, None
        return "", None

    def cards(self, root: str, max_model_len: int) -> list[ModelCard]:
        mc = self.engine.model_config
        task = mc.pooling_kind if mc.runner_type == "pooling" else "generate"
        base = [ModelCard(id=name, root=root, max_model_len=max_model_len, task=task)
                for name in self.served_model_names]
        return base + [ModelCard(id=name, root=r.lora_path, parent=self.served_model_names[0],
                                 max_model_len=max_model_len) for name, r in self.loras.items()]
