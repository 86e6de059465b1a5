"""The attention backend interface: flat-batch metadata and the backend contract."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """What one step's attention needs, for a flat batch of prefill chunks and decodes.

    Requests are laid out one after another in the flat token dimension; request ``i``
    owns tokens ``query_start_loc[i]:query_start_loc[i+1]``, which are the last
    ``query_len`` positions of its ``seq_lens[i]`` tokens (earlier ones are already in
    the paged cache).
    """

    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat slot of each new token's K/V (-1 = skip)
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32: physical block ids per request
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: tokens of context incl. this step's
    # Host copies, so a backend never syncs with the device to read them.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend:
    """Writes new K/V into the paged cache and attends over it.

    ``kv_cache`` for one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads,
    head_dim]`` (index 0 keys, 1 values).
    """

    name: str = "abstract"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        causal: bool = True,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """``causal=False``: every query sees its whole sequence (encoders; the whole sequence
        is in this step, never chunked).
        ``sliding_window``: a query at position p sees keys at positions > p - window.
        ``logits_soft_cap``: scores become ``tanh(s / cap) * cap`` before masking and softmax
        (Gemma 2)."""
        raise NotImplementedError


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)
