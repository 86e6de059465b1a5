"""Triton attention backend (CUDA): the paged KV write and unified paged attention kernels."""
from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.kv_quant import is_fp8
from pagedllm.attention.triton_kernels import count_short_runs, reshape_and_cache, short_run_tokens, unified_attention
from pagedllm.ops.triton_ops import KVWrite, rotary_embedding


class TritonAttentionBackend(AttentionBackend):
    """Two launches per layer (three for a split-KV decode), over grids that depend only on
    tensor shapes, reading only the metadata's device tensors: they can be captured in CUDA
    graphs. ``max_query_len`` is read as a launch-shape hint only (a captured decode graph
    always has 1); any value gives correct results. A step with prefill chunks, which runs its
    attention outside graphs, also reads the host lists once to split its decodes (``_short_runs``)."""

    name = "triton"
    cuda_graph_safe = True

    def __init__(self) -> None:
        # A layer may call rotary_write_kv + attend instead of its rotary + forward (one launch fewer).
        self.fuses_rotary = envs.PAGEDLLM_FUSED_ROTARY_KV

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale, sliding_window=None,
                logits_soft_cap=None, causal=True, kv_scale=None, out=None):
        """``out``: where the attention output goes (shaped like ``query``; default a new tensor)."""
        self.write_kv(key, value, kv_cache, metadata, kv_scale)
        return self.attend(query, kv_cache, metadata, scale, sliding_window, logits_soft_cap, causal, kv_scale, out)

    def write_kv(self, key, value, kv_cache, metadata: AttentionMetadata, kv_scale=None) -> None:
        """The step's K/V into the cache at ``metadata.slot_mapping`` (the piecewise graphs capture
        this half: it reads nothing of the step but the slot mapping's buffer)."""
        fp8 = self.check_kv_scale(key, value, kv_cache, metadata, kv_scale)
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping, kv_scale if fp8 else None)

    def rotary_write_kv(self, positions, query, key, value, kv_cache, metadata: AttentionMetadata, cos_sin_cache,
                        q_norm_weight=None, k_norm_weight=None, eps=0.0, kv_scale=None) -> torch.Tensor:
        """Rotary of ``query`` and ``key`` (each head RMS-normed first with the norm weights: Qwen3),
        and the rotated keys with ``value`` written to the cache as ``write_kv`` writes them, in one
        launch; returns the rotated query for ``attend``. A step that computes the FP8 KV scales
        takes the two launches: the scales come from the rotated K/V before they are written."""
        if metadata.calculate_kv_scales:
            query, key = rotary_embedding(positions, query, key, cos_sin_cache, q_norm_weight, k_norm_weight, eps)
            self.write_kv(key, value, kv_cache, metadata, kv_scale)
            return query
        kv_scale = kv_scale if is_fp8(kv_cache.dtype) else None
        write = KVWrite(value, kv_cache, metadata.slot_mapping, kv_scale)
        return rotary_embedding(positions, query, key, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
                                kv_write=write)[0]

    def attend(self, query, kv_cache, metadata: AttentionMetadata, scale, sliding_window=None, logits_soft_cap=None,
               causal=True, kv_scale=None, out=None):
        """Attention of ``query`` over the cache as ``write_kv`` left it."""
        kv_scale = kv_scale if is_fp8(kv_cache.dtype) else None
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        unified_attention(
            query, kv_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens, scale, out,
            sliding_window, max_query_len=metadata.max_query_len, logits_soft_cap=logits_soft_cap,
            causal=causal, kv_scale=kv_scale,
            short_runs=_short_runs(metadata, query, kv_cache.shape[3], sliding_window),
        )
        return out


def _short_runs(metadata: AttentionMetadata, query: torch.Tensor, num_kv_heads: int,
                sliding_window: int | None) -> tuple[int, int] | None:
    """(count, keys attended) of the step's short query runs (decodes), from the host lists, for a
    step with longer runs: how ``unified_attention`` splits their launch. None in a CUDA graph capture,
    whose replays see other steps (the launch stays unsplit there) and where nothing needs it."""
    if metadata.max_query_len <= 1 or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    threshold = short_run_tokens(query.shape[1], num_kv_heads)
    key = ("short_runs", threshold, sliding_window)
    if key not in metadata.backend_cache:  # once a step (and window): every layer's batch is the same
        metadata.backend_cache[key] = count_short_runs(metadata.query_start_loc_cpu, metadata.seq_lens_cpu,
                                                       threshold, sliding_window)
    return metadata.backend_cache[key]
