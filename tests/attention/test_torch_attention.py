"""The torch (CPU) attention backend against plain float64 attention, in float32 and bfloat16."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend
from tests.attention.test_triton_attention import check, make_batch


@pytest.mark.parametrize("dtype,amx", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("window", [None, 24])
def test_torch_backend_matches_float64_softmax(dtype, amx, window, monkeypatch):
    """Decodes (one padded batch, attended in float32 on CPU whatever the dtype, but in bfloat16
    on CPUs with AMX) and prefill chunks with and without a cached prefix, in one flat batch."""
    from pagedllm.attention import torch_backend

    monkeypatch.setattr(torch_backend, "cpu_has_amx", lambda: amx)
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention",
                        lambda q, *a, **k: calls.append(q.dtype) or real_sdpa(q, *a, **k))
    rng = random.Random(3)
    runs = [(13, 6), (0, 9), (40, 1), (5, 1), (0, 1), (70, 1)]
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=3, head_dim=64, dtype=dtype, runs=runs, device="cpu")
    b.cache.nan_to_num_(0.0)  # the gather reads whole blocks (masked later)
    md = AttentionMetadata(
        num_actual_tokens=b.num_real_tokens, slot_mapping=b.slots, block_tables=b.block_tables,
        query_start_loc=b.qsl, seq_lens=b.seq_lens, query_start_loc_cpu=b.qsl.tolist(),
        seq_lens_cpu=b.seq_lens.tolist(), max_query_len=9, max_seq_len=int(b.seq_lens.max()))
    out = TorchAttentionBackend().forward(b.q, b.k_new, b.v_new, b.cache, md, 0.125, sliding_window=window)
    assert out.dtype == dtype
    check(out, b, 0.125, window, dtype, (dtype, window))
    assert calls[-1] == (dtype if amx else torch.float32)  # the decode batch's call
