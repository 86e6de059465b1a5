"""The runner's adapters: LoRA slots attached to the model's projections, a fixed number of
device slots (``max_loras``, least recently used replaced) fed from a host cache of loaded
adapters (``max_cpu_loras``), and each step's token-to-slot mapping."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.lora.layers import LoRASlots, set_mapping
from pagedllm.lora.peft_loader import LoRAAdapter, load_adapter
from pagedllm.lora.request import LoRARequest

# Our fused projections, and the HF projections stacked in them (in order).
FUSED = {"qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
         "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)), "o_proj": (("o_proj", None),),
         "down_proj": (("down_proj", None),)}


class LoRAManager:
    def __init__(self, model: nn.Module, lora_config: Any, hf_config: Any, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config, self.hf_config, self.device = lora_config, hf_config, device
        self.layers: list[tuple[LoRASlots, list[str]]] = []
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in FUSED or not hasattr(module, "weight"):
                continue
            subs = FUSED[leaf]
            out = module.weight.shape[0]
            parts = [module._shard_range(sid) for _, sid in subs] if len(subs) > 1 else [(0, out)]
            slots = LoRASlots(lora_config.max_loras, lora_config.max_lora_rank, module.weight.shape[1], parts,
                              dtype, device)
            module.lora = slots
            self.layers.append((slots, [name[:-len(leaf)] + hf for hf, _ in subs]))
        self.requests: dict[int, LoRARequest] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> device slot, least recent first
        self.free_slots = list(range(lora_config.max_loras - 1, -1, -1))
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.num_loads = 0  # adapters written into a device slot (tests read it)
        self.pinned: set[int] = set()

    def add_request(self, request: LoRARequest) -> None:
        """A request's adapter: its source is kept (a request naming a known id alone adds nothing)."""
        if request.has_source and request.lora_int_id not in self.requests:
            self.requests[request.lora_int_id] = request

    # ---- RL / runtime management (LLM.add_lora, remove_lora, pin_lora, list_loras) -------------
    def add_adapter(self, request: LoRARequest) -> bool:
        """Load an adapter into the host cache now; one with the same id is replaced (its device
        slot is rewritten the next time a step uses it)."""
        self.remove(request.lora_int_id)
        self.requests[request.lora_int_id] = request
        self._adapter(request.lora_int_id)
        return True

    def remove(self, lora_id: int) -> bool:
        found = self.requests.pop(lora_id, None) is not None
        self.host.pop(lora_id, None)
        self.pinned.discard(lora_id)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return found

    def pin(self, lora_id: int) -> bool:
        """Keep the adapter in its device slot (one slot always stays for the others)."""
        if lora_id not in self.requests:
            raise ValueError(f"lora_int_id {lora_id} is not a loaded adapter")
        if lora_id not in self.pinned and len(self.pinned) + 1 >= self.config.max_loras:
            raise ValueError(f"cannot pin more than max_loras - 1 = {self.config.max_loras - 1} adapters")
        self.pinned.add(lora_id)
        self.activate({lora_id})
        return True

    def list(self) -> set[int]:
        return set(self.requests)

    def _adapter(self, lora_id: int) -> LoRAAdapter:
        adapter = self.host.pop(lora_id, None)
        if adapter is None:
            adapter = load_adapter(self.requests[lora_id], self.hf_config, self.config.max_lora_rank)
        self.host[lora_id] = adapter
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def activate(self, lora_ids: set[int]) -> dict[int, int]:
        """Make the step's adapters resident (the scheduler keeps them within max_loras)."""
        for lora_id in lora_ids & set(self.slot_of):
            self.slot_of.move_to_end(lora_id)
        for lora_id in sorted(lora_ids - set(self.slot_of)):
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                victim = next(i for i in self.slot_of if i not in lora_ids and i not in self.pinned)
                slot = self.slot_of.pop(victim)
            adapter = self._adapter(lora_id)
            for slots, hf_names in self.layers:
                slots.set_slot(slot, [adapter.weights.get(n) for n in hf_names], adapter.scale)
            self.slot_of[lora_id] = slot
            self.num_loads += 1
        return {i: self.slot_of[i] for i in lora_ids}

    def prepare_step(self, lora_ids: np.ndarray, counts: np.ndarray) -> bool:
        """Map the step's tokens to slots (``lora_ids``: each request's adapter, 0 = none;
        ``counts``: its tokens). Returns whether any adapter runs (then no CUDA graph replays)."""
        if not lora_ids.any():
            set_mapping(None, self.device)
            return False
        slot_of = self.activate(set(lora_ids[lora_ids > 0].tolist()))
        slots = np.fromiter((slot_of.get(i, -1) for i in lora_ids.tolist()), dtype=np.int64, count=len(lora_ids))
        set_mapping(np.repeat(slots, counts), self.device)
        return True
