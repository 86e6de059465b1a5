"""LoRA adapters: requests name an adapter (``LoRARequest``); PEFT checkpoints load into a
fixed number of device slots; every wrapped linear adds each token's adapter delta."""
from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
