"""LoRARequest: which adapter a request runs with (vLLM's class and field names)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_int_id`` (> 0) identifies the adapter everywhere (slots, caches, the prefix
    cache); ``lora_path`` is a PEFT adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors`` or ``.bin``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path must name a PEFT adapter folder, got {self.lora_path!r}")
