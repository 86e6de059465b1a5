"""Multi-LoRA on the linear layers: each wrapped linear holds every device slot's A and B,
and adds ``x A_s^T B_s^T`` (scale folded into B) to the rows of the tokens whose request runs
the adapter in slot s. One forward serves a batch mixing adapters and the base model.

A step's token-to-slot mapping is set once (``set_mapping``) before the forward and read by
every wrapped layer; with no adapter in the step the layers do nothing extra.
"""
from __future__ import annotations

import numpy as np
import torch


class _Mapping:
    """This step's adapter groups: (slot, the flat-batch rows of its tokens), and every
    token's slot on the device (-1: the base model), which the Triton kernels read."""

    groups: list[tuple[int, torch.Tensor]] = []
    token_slots: torch.Tensor | None = None


MAPPING = _Mapping()


def set_mapping(token_slots: np.ndarray | None, device: torch.device) -> None:
    """``token_slots``: each token's slot (-1: the base model); None clears the mapping."""
    if token_slots is None or not (token_slots >= 0).any():
        MAPPING.groups, MAPPING.token_slots = [], None
        return
    MAPPING.token_slots = torch.from_numpy(token_slots).to(device)
    MAPPING.groups = [(int(s), torch.from_numpy(np.flatnonzero(token_slots == s)).to(device))
                      for s in np.unique(token_slots[token_slots >= 0])]


class LoRASlots:
    """The slots of one linear whose output stacks ``parts`` (offset, size) projections (q, k,
    v; gate, up; or one): A [slots, parts * rank, in] and a block-diagonal B
    [slots, out, parts * rank], so one shrink and one expand serve a fused projection."""

    def __init__(self, max_loras: int, max_rank: int, in_features: int, parts: list[tuple[int, int]],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.max_rank, self.parts = max_rank, parts
        out = sum(size for _, size in parts)
        self.A = torch.zeros(max_loras, len(parts) * max_rank, in_features, dtype=dtype, device=device)
        self.B = torch.zeros(max_loras, out, len(parts) * max_rank, dtype=dtype, device=device)

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None], scale: float) -> None:
        """Write one adapter's (A, B) per part (None: that projection is not adapted)."""
        self.A[slot].zero_()
        self.B[slot].zero_()
        for i, ((offset, size), pair) in enumerate(zip(self.parts, pairs)):
            if pair is None:
                continue
            a, b = pair
            r, lo = a.shape[0], i * self.max_rank
            self.A[slot, lo:lo + r] = a.to(self.A)
            self.B[slot, offset:offset + size, lo:lo + r] = (b.float() * scale).to(self.B)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.shape[0] <= _triton_max_tokens(x):  # decode: one launch for any mix of adapters
            from pagedllm.ops.triton_lora import lora_apply

            return lora_apply(x.contiguous(), y, self.A, self.B, MAPPING.token_slots)
        for slot, rows in MAPPING.groups:
            xs = x.index_select(0, rows).to(self.A.dtype)
            y.index_add_(0, rows, ((xs @ self.A[slot].t()) @ self.B[slot].t()).to(y.dtype))
        return y


def _triton_max_tokens(x: torch.Tensor) -> int:
    """How many tokens the Triton kernels take (0 where the Triton ops are off)."""
    from pagedllm.ops import triton_ops_for

    if triton_ops_for(x) is None:
        return 0
    from pagedllm.ops.triton_lora import MAX_TOKENS

    return MAX_TOKENS
