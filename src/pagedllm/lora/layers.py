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
    # On CUDA: the tokens sorted by slot in tiles, and each tile's slot (ops/triton_lora.py);
    # for steps of a few tokens also each token's slot (-1: base), read by the small-row GEMM
    # kernels that add the adapters' expand in their epilogue (ops/triton_gemv.py).
    sorted_ids: torch.Tensor | None = None
    tile_slots: torch.Tensor | None = None
    token_slots: torch.Tensor | None = None


FUSED_ROWS = 32  # the small-row kernels' most rows (ops/triton_gemv.MAX_ROWS)


MAPPING = _Mapping()


def set_graph_mapping(sorted_ids: torch.Tensor, tile_slots: torch.Tensor, token_slots: torch.Tensor | None) -> None:
    """Map through fixed device buffers (a CUDA graph's, captured and replayed over them)."""
    MAPPING.groups = [(-1, sorted_ids)]  # not empty: the wrapped layers apply their adapters
    MAPPING.sorted_ids, MAPPING.tile_slots, MAPPING.token_slots = sorted_ids, tile_slots, token_slots


def set_mapping(token_slots: np.ndarray | None, device: torch.device) -> None:
    """``token_slots``: each token's slot (-1: the base model); None clears the mapping."""
    if token_slots is None or not (token_slots >= 0).any():
        MAPPING.groups, MAPPING.sorted_ids, MAPPING.tile_slots, MAPPING.token_slots = [], None, None, None
        return
    if device.type == "cuda" and _triton_lora_enabled(device):
        from pagedllm.ops.triton_lora import sort_by_slot

        ids, tiles = sort_by_slot(token_slots)
        fused = torch.from_numpy(token_slots).to(device, non_blocking=True) if len(token_slots) <= FUSED_ROWS else None
        set_graph_mapping(torch.from_numpy(ids).to(device, non_blocking=True),
                          torch.from_numpy(tiles).to(device, non_blocking=True), fused)
        return
    MAPPING.sorted_ids = MAPPING.tile_slots = MAPPING.token_slots = None
    MAPPING.groups = [(int(s), torch.from_numpy(np.flatnonzero(token_slots == s)).to(device))
                      for s in np.unique(token_slots[token_slots >= 0])]


class LoRASlots:
    """The slots of one linear whose output stacks ``parts`` (offset, size) projections (q, k,
    v; gate, up; or one): A [slots, parts * rank, in] and a block-diagonal B
    [slots, out, parts * rank], so one shrink and one expand serve a fused projection.

    Tensor parallelism: a column-parallel linear holds its rows of each projection, so each
    part's B keeps the rows ``b_rows[i]`` (start in the full projection) and A stays whole; a
    row-parallel one holds the input columns ``a_cols`` (start, size), so A keeps those columns
    and B stays whole. Its delta is then this rank's partial sum, added before the layer's
    all-reduce, which adds the ranks' parts up: no collective of its own."""

    def __init__(self, max_loras: int, max_rank: int, in_features: int, parts: list[tuple[int, int]],
                 dtype: torch.dtype, device: torch.device, b_rows: list[int] | None = None,
                 a_cols: tuple[int, int] | None = None) -> None:
        self.max_rank, self.parts = max_rank, parts
        self.b_rows, self.a_cols = b_rows, a_cols
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
            if self.a_cols is not None:
                a = a[:, self.a_cols[0]:self.a_cols[0] + self.a_cols[1]]
            if self.b_rows is not None:
                b = b[self.b_rows[i]:self.b_rows[i] + size]
            r, lo = a.shape[0], i * self.max_rank
            self.A[slot, lo:lo + r] = a.to(self.A)
            self.B[slot, offset:offset + size, lo:lo + r] = (b.float() * scale).to(self.B)

    def shrink(self, x: torch.Tensor):
        """On the Triton path: the shrink launched, its expand left to the projection's GEMM
        (``ops.triton_ops.linear(..., lora=)``); None elsewhere (``apply`` after the GEMM)."""
        if MAPPING.tile_slots is None or not x.is_cuda:
            return None
        from pagedllm.ops.triton_lora import lora_shrink, pdl_supported

        fused = x.shape[0] <= FUSED_ROWS
        return lora_shrink(x.contiguous(), self.A, self.B, MAPPING.sorted_ids, MAPPING.tile_slots,
                           MAPPING.token_slots if fused else None, pdl=fused and pdl_supported(x.device))

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        delta = self.shrink(x)  # two launches for any mix of adapters
        if delta is not None:
            return delta.expand_into(y)
        if MAPPING.tile_slots is not None:  # a step whose tiles are all padding
            return y
        for slot, rows in MAPPING.groups:
            xs = x.index_select(0, rows).to(self.A.dtype)
            y.index_add_(0, rows, ((xs @ self.A[slot].t()) @ self.B[slot].t()).to(y.dtype))
        return y


def _triton_lora_enabled(device: torch.device) -> bool:
    """The Triton kernels run where the Triton ops do (CUDA, not disabled)."""
    from pagedllm.ops import triton_ops_for

    return triton_ops_for(torch.empty(0, device=device)) is not None
