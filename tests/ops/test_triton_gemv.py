"""The small-row Triton GEMM equals F.linear: row counts 1..32, bias or none, half
precision, K tiles of 64..512, N not a multiple of the tile, a strided x (rows of a wider
buffer). ‖out − ref‖/‖ref‖ against float64, and against F.linear in the same dtype (one
rounding of an fp32 accumulation each, in a different summation order)."""
from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import DEVICE

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k, block_n, kernel, bias", [
    (1, 200, 256, 32, "dot", False),
    (1, 200, 256, 16, "gemv", True),
    (3, 96, 192, 16, "dot", True),
    (8, 130, 512, 64, "dot", False),
    (16, 64, 128, 32, "dot", True),
    (29, 80, 256, 16, "dot", False),
])
def test_small_m_linear_matches_linear(triton_gemv, dtype, m, n, k, block_n, kernel, bias):
    g = torch.Generator().manual_seed(m * 1000 + n)
    wide = torch.randn(m, k + 64, generator=g).to(DEVICE, dtype)
    x = wide[:, 32:32 + k]  # row stride k + 64
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    y = triton_gemv.small_m_linear(x, w, b, block_n=block_n, kernel=kernel)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    same = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y, exact) < TOL[dtype]
    assert _rel(y, same) < TOL[dtype] / 2


def test_block_k_choice_and_refusals(triton_gemv):
    assert triton_gemv.block_k_for(14336) == 512 and triton_gemv.block_k_for(896) == 128
    assert triton_gemv.block_k_for(100) is None
    x = torch.zeros(33, 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="small_m_linear"):
        triton_gemv.small_m_linear(x, torch.zeros(8, 128, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 64"):
        triton_gemv.small_m_linear(x[:2, :100], torch.zeros(8, 100, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.parametrize("m, numel_big", [(1, False), (4, True), (4, False), (24, True), (33, True)])
def test_linear_dispatch(triton_ops, triton_gemv, monkeypatch, m, numel_big):
    """triton_ops.linear: 1 row on the one-row kernel, 2-16 rows on the dot kernel for weights of
    4M elements and up (17-32 rows: 20M), anything else (and float32) on F.linear itself."""
    calls = []
    real = triton_ops.small_m_linear
    monkeypatch.setattr(triton_ops, "small_m_linear", lambda *a, **kw: calls.append(kw["kernel"]) or real(*a, **kw))
    n, k = ((4096, 1024) if m <= 16 else (20480, 1024)) if numel_big else (64, 128)
    x = torch.randn(m, k).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k) / k ** 0.5).to(DEVICE, torch.bfloat16)
    y = triton_ops.linear(x, w)
    assert _rel(y, x.double() @ w.double().T) < TOL[torch.bfloat16]
    expected = {1: ["gemv"], 4: ["dot"] if numel_big else [], 24: ["dot"], 33: []}[m]
    assert calls == expected
    calls.clear()
    triton_ops.linear(x.float(), w.float())
    assert calls == []
