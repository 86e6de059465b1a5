"""LoRARequest: which adapter a request runs with (vLLM's class and field names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """``lora_int_id`` (> 0) identifies the adapter everywhere (slots, caches, the prefix
    cache); ``lora_path`` is a PEFT adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors`` or ``.bin``). A trainer may instead pass the adapter in
    memory: ``tensors`` (PEFT's state-dict names) and ``peft_config`` (adapter_config.json's
    keys), through ``LLM.add_lora``; later requests then name the id alone."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensors: dict[str, Any] | None = field(default=None, repr=False)
    peft_config: dict[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_request.lora_path must be a string (a PEFT adapter folder), got {self.lora_path!r}")
        if (self.tensors is None) != (self.peft_config is None):
            raise ValueError("lora_request: tensors and peft_config go together (an adapter in memory)")

    @property
    def has_source(self) -> bool:
        """Whether the request says where the adapter's weights are (else: an id added before)."""
        return bool(self.lora_path) or self.tensors is not None
