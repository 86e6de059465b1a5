"""Routed experts for RL (``enable_return_routed_experts``): the expert ids each MoE layer picked
for every token a request computed, so a trainer can replay the same routing.

Each MoE layer writes its top-k ids into a fixed device buffer (one row per token of the step:
CUDA graphs capture the write). After the forward the step's rows are stored by KV-cache slot,
beside the token's K/V: a later request that hits the prefix cache finds the routing of the
prefix it did not compute there, as it finds its K/V. Each step then reports, per request, the
rows of the positions it computed (from position 0 when the request starts, prefix hits included).
Built only when the option is on: without it no layer writes anything.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.core.sched_output import SchedulerOutput

ROUTED_DTYPE = torch.int16  # expert ids (< 32768 experts)


class RoutedExpertsCapture:
    def __init__(self, model: nn.Module, max_rows: int, block_size: int, device: torch.device):
        blocks = model.moe_blocks() if hasattr(model, "moe_blocks") else []
        if not blocks:
            raise ValueError("enable_return_routed_experts needs a mixture-of-experts model; "
                             f"{type(model).__name__} has no MoE layers")
        self.num_layers, self.top_k = len(blocks), blocks[0].top_k
        self.block_size, self.device = block_size, device
        self.step_rows = torch.zeros(self.num_layers, max_rows, self.top_k, dtype=ROUTED_DTYPE, device=device)
        for layer, block in enumerate(blocks):
            block.routed_experts_out = self.step_rows[layer]
        self.by_slot: torch.Tensor | None = None  # [num_slots, layers, top_k], beside the KV cache

    def bytes_per_block(self) -> int:
        return self.block_size * self.num_layers * self.top_k * ROUTED_DTYPE.itemsize

    def allocate(self, num_blocks: int) -> None:
        self.by_slot = torch.zeros(num_blocks * self.block_size, self.num_layers, self.top_k, dtype=ROUTED_DTYPE,
                                   device=self.device)

    def free(self) -> None:
        self.by_slot = None

    def _slots(self, block_table_row: np.ndarray, lo: int, hi: int) -> np.ndarray:
        positions = np.arange(lo, hi)
        return block_table_row[positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size

    def collect(self, sched: SchedulerOutput, req_ids: list[str], block_tables: np.ndarray, rows: np.ndarray,
                starts: list[int], query_start_loc: list[int]) -> tuple[list[tuple[str, int, int]], torch.Tensor]:
        """Store this step's rows by slot; return (req_id, first position, row count) per request
        and the rows themselves, concatenated in that order (still on the device)."""
        started = {new.req_id for new in sched.scheduled_new_reqs}
        step_slots, wanted, spans = [], [], []
        for i, req_id in enumerate(req_ids):
            table, start = block_tables[rows[i]], starts[i]
            end = start + query_start_loc[i + 1] - query_start_loc[i]
            step_slots.append(self._slots(table, start, end))
            lo = 0 if req_id in started else start  # a (re)started request reports its prefix hits too
            wanted.append(self._slots(table, lo, end))
            spans.append((req_id, lo, end - lo))
        num_tokens = query_start_loc[-1]
        step_index = torch.from_numpy(np.concatenate(step_slots)).to(self.device)
        self.by_slot[step_index] = self.step_rows[:, :num_tokens].transpose(0, 1)
        return spans, self.by_slot[torch.from_numpy(np.concatenate(wanted)).to(self.device)]


def split_routed(spans: list[tuple[str, int, int]], rows: torch.Tensor) -> dict[str, tuple[int, np.ndarray]]:
    """Per request: (first position, its rows [n, layers, top_k]) on the host."""
    host = rows.cpu().numpy()
    out, offset = {}, 0
    for req_id, first, n in spans:
        out[req_id] = (first, host[offset:offset + n])
        offset += n
    return out
