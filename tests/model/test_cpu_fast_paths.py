"""The torch path's shortcuts give what the plain ops give: RMSNorm in float32 as one
``torch.rms_norm`` (bit for bit the six-op formula HF's Llama norm runs), rotary with q and k
rotated in one pass when k's heads follow q's in the projection output."""
from __future__ import annotations

import pytest
import torch

from pagedllm.model.layers import RMSNorm
from pagedllm.model.rotary import RotaryEmbedding, _adjacent_heads, _rotate


@pytest.mark.parametrize("hidden, rows", [(64, 1), (576, 32), (960, 7), (4096, 100)])
def test_float32_rms_norm_is_the_six_op_formula_bit_for_bit(hidden, rows):
    g = torch.Generator().manual_seed(hidden + rows)
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
    for scale in (1e-3, 1.0, 300.0):
        x = torch.randn(rows, hidden, generator=g) * scale
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
        assert torch.equal(norm(x), norm.weight * h)
        res = torch.randn(rows, hidden, generator=g)
        out, new_res = norm(x, res)
        assert torch.equal(new_res, x + res)
        hr = (x + res) * torch.rsqrt((x + res).pow(2).mean(-1, keepdim=True) + norm.eps)
        assert torch.equal(out, norm.weight * hr)


class _Cfg:
    rope_theta = 10000.0
    rope_scaling = None


def _qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v


def test_rotary_of_adjacent_q_and_k_in_one_pass_equals_each_alone():
    rope = RotaryEmbedding(64, 256, _Cfg())
    q, k, _ = _qkv(9, 9, 3, 64)
    assert _adjacent_heads(q, k) is not None
    positions = torch.randint(0, 256, (9,))
    got_q, got_k = rope(positions, q, k)
    cos, sin = rope.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    assert torch.equal(got_q, _rotate(q, cos, sin)) and torch.equal(got_k, _rotate(k, cos, sin))
    # Not adjacent (separate tensors, or v after q): each is rotated alone, same values.
    q2, k2 = q.clone(), k.clone()
    assert _adjacent_heads(q2, k2) is None and _adjacent_heads(q, q) is None
    assert all(torch.equal(a, b) for a, b in zip(rope(positions, q2, k2), (got_q, got_k)))
