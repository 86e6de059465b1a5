"""The encoders' bidirectional attention (``causal=False``): the Triton kernel (Triton's
interpreter without a GPU) and the torch backend against a float64 softmax over each whole
sequence, with mixed lengths (short and long tiles), GQA and scrambled block tables."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend
from tests.attention.test_triton_attention import TOL, make_batch
from tests.triton_env import ON_GPU


def _reference(b, scale: float) -> torch.Tensor:
    group = b.q.shape[1] // b.ks[0].shape[1]
    outs, start = [], 0
    for k, v, ql in zip(b.ks, b.vs, b.q_lens):
        q = b.q[start:start + ql].double().cpu()
        kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * scale
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
        start += ql
    return torch.cat(outs)


CASES = [(torch.float32, [1, 7, 40], 2, 1), (torch.float32, [33, 5], 1, 4)]
if ON_GPU:
    CASES += [(torch.bfloat16, [1, 200, 64, 513, 17], 8, 4), (torch.float16, [128] * 9, 2, 2)]


@pytest.mark.parametrize("dtype,lens,num_kv_heads,group", CASES)
def test_noncausal_kernel_and_torch_backend_match_reference(kernels, dtype, lens, num_kv_heads, group):
    rng = random.Random(sum(lens))
    b = make_batch(rng, block_size=16, num_kv_heads=num_kv_heads, group=group, head_dim=32, dtype=dtype,
                   runs=[(0, n) for n in lens])
    scale = 32**-0.5
    ref = _reference(b, scale)
    cache = b.cache.clone()
    kernels.reshape_and_cache(b.k_new, b.v_new, cache, b.slots)
    out = torch.full_like(b.q, float("nan"))
    kernels.unified_attention(b.q, cache, b.block_tables, b.qsl, b.seq_lens, scale, out, causal=False,
                              max_query_len=max(lens))
    got = out[:b.num_real_tokens].double().cpu()
    assert ((got - ref).norm() / ref.norm()).item() < TOL[dtype]
    # The causal kernel differs: the mask is really off.
    causal = torch.full_like(b.q, float("nan"))
    kernels.unified_attention(b.q, cache, b.block_tables, b.qsl, b.seq_lens, scale, causal)
    assert (causal[:b.num_real_tokens].double().cpu() - ref).abs().max() > 1e-3

    qsl = b.qsl.tolist()
    md = AttentionMetadata(num_actual_tokens=b.num_real_tokens, slot_mapping=b.slots, block_tables=b.block_tables,
                           query_start_loc=b.qsl, seq_lens=b.seq_lens, query_start_loc_cpu=qsl,
                           seq_lens_cpu=b.seq_lens.tolist(), max_query_len=max(lens), max_seq_len=max(lens))
    n = b.num_real_tokens
    torch_out = TorchAttentionBackend().forward(b.q[:n], b.k_new[:n], b.v_new[:n], b.cache.clone(), md, scale,
                                                causal=False)
    assert ((torch_out.double().cpu() - ref).norm() / ref.norm()).item() < TOL[dtype]
