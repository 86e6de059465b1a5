"""The attention backend interface: flat-batch metadata and the backend contract."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagedllm.attention.kv_quant import calculate_kv_scales_, is_fp8


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
    # FP8 KV cache with calculate_kv_scales: this step's K/V set each layer's scales before they
    # are written (the runner asks once, on the first real step).
    calculate_kv_scales: bool = False
    # Models whose layers form several KV cache groups (core/kv_cache_groups.py): the metadata of
    # groups 1.. (their own block tables and slot mappings, the rest shared); this object is
    # group 0's. Empty: every layer reads this one (one group, or a start-up forward whose
    # scratch cache any table addresses).
    group_metadata: tuple["AttentionMetadata", ...] = ()
    # What a backend derives from this step's metadata once and every layer reuses (the torch
    # backend's decode gather ids and key mask); its own per object, groups included.
    backend_cache: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata the layers of KV cache group ``group`` attend with."""
        if group == 0 or not self.group_metadata:
            return self
        return self.group_metadata[group - 1]

    def with_groups(self, tables: list[tuple[torch.Tensor, torch.Tensor]]) -> "AttentionMetadata":
        """This metadata (group 0's) with groups 1..'s (block_tables, slot_mapping) attached."""
        self.group_metadata = tuple(dataclasses.replace(self, block_tables=bt, slot_mapping=sm, backend_cache={})
                                    for bt, sm in tables)
        return self


class AttentionBackend:
    """Writes new K/V into the paged cache and attends over it.

    ``kv_cache`` for one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads,
    head_dim]`` (index 0 keys, 1 values), in the model dtype or in float8 (e4m3fn / e5m2):
    then ``kv_scale`` (float32 ``[k_scale, v_scale]``, attention/kv_quant.py) quantizes the
    writes and dequantizes the reads, and every key and value attended, this step's included,
    is the one read back from the cache.
    """

    name: str = "abstract"
    # True where the backend has ``rotary_write_kv`` (rotary and the KV write in one launch, then
    # ``attend``): the Triton backend's layers call that pair instead of rotary + ``forward``.
    fuses_rotary: bool = False

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
        kv_scale: torch.Tensor | None = None,
        causal: bool = True,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """``causal=False``: every query sees its whole sequence (encoders; the whole sequence
        is in this step, never chunked).
        ``sliding_window``: a query at position p sees keys at positions > p - window.
        ``logits_soft_cap``: scores become ``tanh(s / cap) * cap`` before masking and softmax
        (Gemma 2)."""
        raise NotImplementedError

    @staticmethod
    def check_kv_scale(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                       kv_scale: torch.Tensor | None) -> bool:
        """Whether the cache is fp8 (then ``kv_scale`` must be given); with
        ``metadata.calculate_kv_scales`` the scales are set from this step's K/V first."""
        if not is_fp8(kv_cache.dtype):
            return False
        if kv_scale is None:
            raise ValueError(f"a {kv_cache.dtype} KV cache needs kv_scale ([k_scale, v_scale], float32)")
        if metadata.calculate_kv_scales:
            n = metadata.num_actual_tokens
            calculate_kv_scales_(kv_scale, key[:n], value[:n])
        return True


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)
