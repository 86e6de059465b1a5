"""The runner's adapters: LoRA slots attached to the model's projections, a fixed number of
device slots (``max_loras``, least recently used replaced) fed from a host cache of loaded
adapters (``max_cpu_loras``), and each step's token-to-slot mapping."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.lora.layers import FUSED_ROWS, LoRASlots, set_graph_mapping, set_mapping
from pagedllm.model.layers import MergedLinear, RowParallelLinear
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
            out = module.out_features
            parts = [module._shard_range(sid) for _, sid in subs] if len(subs) > 1 else [(0, out)]
            b_rows = a_cols = None
            if getattr(module, "tp_size", 1) > 1:  # this rank's slice of the adapters (LoRASlots)
                if isinstance(module, MergedLinear):
                    b_rows = [module._shard_start(module._shard_index(sid)) for _, sid in subs] \
                        if len(subs) > 1 else [module._shard_start(0)]
                elif isinstance(module, RowParallelLinear):
                    a_cols = (module.tp_rank * module.input_size_per_rank, module.input_size_per_rank)
            slots = LoRASlots(lora_config.max_loras, lora_config.max_lora_rank, module.in_features, parts,
                              dtype, device, b_rows, a_cols)
            module.lora = slots
            self.layers.append((slots, [name[:-len(leaf)] + hf for hf, _ in subs]))
        self.requests: dict[int, LoRARequest] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> device slot, least recent first
        self.free_slots = list(range(lora_config.max_loras - 1, -1, -1))
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.num_loads = 0  # adapters written into a device slot (tests read it)
        self.max_graph_tokens = 0  # set by capture: the most tokens a LoRA graph (decode or piecewise) takes
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

    def prepare_step(self, lora_ids: np.ndarray, counts: np.ndarray, graph_size: int | None = None) -> bool:
        """Map the step's tokens to slots (``lora_ids``: each request's adapter, 0 = none;
        ``counts``: its tokens); ``graph_size``: the tokens of the LoRA graph the step replays (a
        decode graph's, or the piecewise graphs' padded count), mapped through its buffers.
        Returns whether any adapter runs."""
        if not lora_ids.any():
            set_mapping(None, self.device)
            return False
        slot_of = self.activate(set(lora_ids[lora_ids > 0].tolist()))
        slots = np.fromiter((slot_of.get(i, -1) for i in lora_ids.tolist()), dtype=np.int64, count=len(lora_ids))
        token_slots = np.repeat(slots, counts)
        if graph_size is None:
            set_mapping(token_slots, self.device)
        else:
            self._fill_graph_buffers(token_slots, graph_size)
        return True

    # ---- CUDA graphs of decode steps with adapters -----------------------------------------------
    def graphs_supported(self) -> bool:
        """LoRA graphs need the Triton kernels (their grid is fixed; the torch path is not)."""
        from pagedllm.lora.layers import _triton_lora_enabled

        return self.device.type == "cuda" and _triton_lora_enabled(self.device)

    def clear_mapping(self) -> None:
        set_mapping(None, self.device)

    def graph_buffers(self, graph_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fixed sorted-ids / tile-slot / token-slot buffers a LoRA graph of ``graph_size``
        tokens reads."""
        from pagedllm.ops.triton_lora import BLOCK_M, max_tiles

        if not hasattr(self, "_ids_buf"):
            tiles = max_tiles(self.max_graph_tokens, self.config.max_loras)
            self._ids_buf = torch.full((tiles * BLOCK_M,), -1, dtype=torch.int64, device=self.device)
            self._tiles_buf = torch.full((tiles,), -1, dtype=torch.int64, device=self.device)
            self._slots_buf = torch.full((self.max_graph_tokens,), -1, dtype=torch.int64, device=self.device)
        tiles = max_tiles(graph_size, self.config.max_loras)
        return self._ids_buf[:tiles * BLOCK_M], self._tiles_buf[:tiles], self._slots_buf[:graph_size]

    def _map_graph(self, graph_size: int) -> None:
        ids, tiles, slots = self.graph_buffers(graph_size)
        set_graph_mapping(ids, tiles, slots if graph_size <= FUSED_ROWS else None)

    def capture_mapping(self, graph_size: int) -> None:
        """Before capturing a LoRA graph: map through its buffers (all -1 now: no-op kernels)."""
        for buf in self.graph_buffers(graph_size):
            buf.fill_(-1)
        self._map_graph(graph_size)

    def _fill_graph_buffers(self, slots: np.ndarray, graph_size: int) -> None:
        from pagedllm.ops.triton_lora import sort_by_slot

        ids, tiles = sort_by_slot(slots)  # each token's slot
        for buf, values in zip(self.graph_buffers(graph_size), (ids, tiles, slots)):
            host = np.full(buf.shape[0], -1, dtype=np.int64)
            host[:len(values)] = values
            buf.copy_(torch.from_numpy(host), non_blocking=False)
        self._map_graph(graph_size)


def lora_manager_for(input_batch: Any, config: Any, model: nn.Module, device: torch.device,
                     model_dtype: torch.dtype) -> LoRAManager | None:
    """With enable_lora: LoRA slots on the projections, and each request's adapter id as an
    input-batch column; None without."""
    lc = config.lora_config
    if lc is None:
        return None
    from pagedllm.model.loader import TORCH_DTYPES
    from pagedllm.worker.input_batch import Column

    dtype = model_dtype if lc.lora_dtype == "auto" else TORCH_DTYPES[lc.lora_dtype]
    input_batch.add_column(Column("lora_id", np.int64, 0, lambda new: new.lora_request.lora_int_id
                                  if new.lora_request is not None else 0))
    return LoRAManager(model, lc, config.model_config.hf_config, device, dtype)
