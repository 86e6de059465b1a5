"""Triton attention backend (CUDA): the KV write and unified paged attention kernels."""
from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.triton_kernels import reshape_and_cache, unified_attention


class TritonAttentionBackend(AttentionBackend):
    """Reads only the metadata's device tensors (and max_query_len, fixed per captured
    graph), so its launches can be captured in CUDA graphs."""

    name = "triton"
    cuda_graph_safe = True

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale, sliding_window=None):
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        n = metadata.num_actual_tokens
        unified_attention(query[:n], kv_cache, out[:n], metadata.block_tables, metadata.seq_lens,
                          metadata.query_start_loc, scale, metadata.max_query_len, sliding_window)
        return out
