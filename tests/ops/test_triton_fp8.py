"""The block-scaled FP8 Triton GEMM equals the torch path of pagedllm.model.quantization.fp8 (the
same fp8 values times their row-group and weight-block scales, in float32): rows 1..32 and
prefill sizes, blocks of 32 and 128, K not a multiple of the block (a partial last block), N
not a multiple of the tile or the block, scales that differ per block. Triton's interpreter runs
the fp8 dot by upcasting (so this runs on CPU); on a GPU the dot is the fp8 tensor-core one.
‖out − ref‖/‖ref‖ < 1e-5 in float32 output, 1e-2 in bfloat16."""
from __future__ import annotations

import pytest
import torch

from pagedllm.model.quantization.fp8 import (
    FP8_DTYPE, block_scales_to_elements, fp8_block_linear, quantize_per_token_group,
)
from pagedllm.ops.tile_tables import TileTable
from tests.ops.conftest import DEVICE


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m, n, k, block", [
    (1, 96, 256, (32, 32)),
    (7, 80, 200, (32, 64)),
    (32, 256, 256, (128, 128)),
    (33, 200, 384, (128, 128)),
    (70, 64, 160, (32, 32)),
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_matmul_matches_dequantized_product(triton_fp8, m, n, k, block, out_dtype):
    bn, bk = block
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g)
    kp = -(-k // bk) * bk  # activations are quantized in whole groups: pad K for the scales
    xq, xs = quantize_per_token_group(torch.nn.functional.pad(x, (0, kp - k)), bk)
    xq = xq[:, :k].contiguous()
    w_scale = torch.rand(-(-n // bn), -(-k // bk), generator=g) * 0.01 + 0.001
    wq = torch.randn(n, k, generator=g).mul(100).clamp(-448, 448).to(FP8_DTYPE)
    y = triton_fp8.fp8_block_matmul(xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), w_scale.to(DEVICE), block, out_dtype)
    x_dq = xq.float() * xs.repeat_interleave(bk, 1)[:, :k]
    ref = x_dq.double() @ (wq.float() * block_scales_to_elements(w_scale, n, k, bn, bk)).double().t()
    assert y.shape == (m, n) and y.dtype == out_dtype
    # float32 out: 1e-5 in the interpreter (exact products); a GPU's fp8 tensor-core dot sums in
    # another order, measured 4e-5..1.3e-4 on an H100.
    tol32 = 5e-4 if y.is_cuda else 1e-5
    assert _rel(y.cpu(), ref) < (tol32 if out_dtype == torch.float32 else 1e-2)


def test_fp8_block_linear_torch_path_equals_kernel_inputs():
    """The CPU path of a block-wise layer: activations per token and K group, weights per tile."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 128, generator=g)
    wq = torch.randn(64, 128, generator=g).mul(50).to(FP8_DTYPE)
    w_scale = torch.rand(2, 2, generator=g) * 0.01
    y = fp8_block_linear(x, wq, w_scale, None, (32, 64))
    xq, xs = quantize_per_token_group(x, 64)
    ref = (xq.float() * xs.repeat_interleave(64, 1)) @ (wq.float() * block_scales_to_elements(w_scale, 64, 128, 32, 64)).t()
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m, n, k, bias", [(1, 96, 256, False), (5, 200, 320, True), (16, 64, 512, False),
                                           (29, 80, 200, True), (70, 96, 320, True)])
def test_fp8_small_m_kernel_matches_float32_products(triton_fp8, m, n, k, bias):
    """The decode kernel: per-row activation and per-channel weight scales, K not a multiple of
    the 256-wide tile, bias in bfloat16; 70 rows in two row tiles of 64 (the last partial)."""
    from pagedllm.model.quantization.fp8 import quantize_per_token

    g = torch.Generator().manual_seed(m * 3 + n)
    x = torch.randn(m, k, generator=g)
    xq, xs = quantize_per_token(x)
    wq = torch.randn(n, k, generator=g).mul(100).clamp(-448, 448).to(FP8_DTYPE)
    ws = torch.rand(n, generator=g) * 0.001 + 1e-4
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    y = triton_fp8.fp8_small_m_linear(xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE),
                                      None if b is None else b.to(DEVICE), torch.bfloat16)
    ref = (xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).t() + (b.double() if bias else 0)
    assert y.shape == (m, n) and _rel(y.cpu(), ref) < 1e-2


@pytest.mark.parametrize("m, n, k, split, block_m", [(1, 96, 1024, 4, None), (5, 200, 1000, 3, None),
                                                     (29, 80, 640, 8, None), (100, 80, 640, 3, 64),
                                                     (129, 40, 384, 2, 128)])
def test_fp8_small_m_kernel_split_k_equals_the_whole_k(triton_fp8, m, n, k, split, block_m):
    """K split over programs (the last split's tile partial, splits rounded to whole tiles: 8 on
    5 tiles runs 5): the float32 products of the whole-K kernel up to summation order, bias
    added once, run twice (the counters reset), each (row tile, column tile)'s counter back at 0.
    Past 32 rows in row tiles (the last partial): each row tile's columns count apart."""
    from pagedllm.model.quantization.fp8 import quantize_per_token
    from pagedllm.ops import triton_splitk

    g = torch.Generator().manual_seed(m + k)
    xq, xs = quantize_per_token(torch.randn(m, k, generator=g))
    wq = torch.randn(n, k, generator=g).mul(100).clamp(-448, 448).to(FP8_DTYPE).to(DEVICE)
    ws = (torch.rand(n, generator=g) * 0.001 + 1e-4).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE)
    args = (xq.to(DEVICE), xs.to(DEVICE), wq, ws, b, torch.float32)
    ref = (xq.double() * xs.double()) @ (wq.cpu().double() * ws.cpu().double()[:, None]).t() + b.cpu().double()
    whole = triton_fp8.fp8_small_m_linear(*args, block_n=32, block_k=128, block_m=block_m)
    parts = triton_fp8.fp8_small_m_linear(*args, block_n=32, block_k=128, split_k=split, block_m=block_m)
    # The interpreter's products are exact; a GPU's fp8 tensor-core dot sums in another order (as above).
    assert _rel(whole.cpu(), ref) < (5e-4 if whole.is_cuda else 1e-5) and _rel(parts.cpu(), whole.cpu()) < 1e-6
    assert torch.equal(triton_fp8.fp8_small_m_linear(*args, block_n=32, block_k=128, split_k=split, block_m=block_m),
                       parts)
    assert int(triton_splitk._COUNTERS[parts.device, "gemm"].abs().sum()) == 0


def test_outgrown_counters_stay_allocated(monkeypatch):
    """A launch larger than the counters replaces them with a larger buffer, but the old one is never
    freed: CUDA graphs captured before hold its address and count in it on every replay. Owners are
    apart (the attention's counters are not the GEMMs')."""
    import gc
    import weakref

    from pagedllm.ops import triton_splitk

    monkeypatch.setattr(triton_splitk, "_COUNTERS", {})
    monkeypatch.setattr(triton_splitk, "_OUTGROWN", [])
    small = triton_splitk.counters(torch.device(DEVICE), 10, owner="test")
    assert small.numel() >= 10 and not small.any()
    assert triton_splitk.counters(torch.device(DEVICE), 10, owner="other") is not small
    kept = weakref.ref(small)
    del small
    large = triton_splitk.counters(torch.device(DEVICE), 10 ** 5, owner="test")
    gc.collect()
    assert large.numel() >= 10 ** 5 and kept() is not None and kept() is not large
    assert triton_splitk.counters(torch.device(DEVICE), 10, owner="test") is large


def test_fp8_decode_config_reads_the_tuned_table(triton_fp8, tmp_path, monkeypatch):
    """Row buckets from the table (the next bucket up), ``scaled_mm`` entries to cuBLAS, untuned
    shapes to the default up to 16 rows, row tiles where the table has them, more than MAX_ROWS rows
    never to the small-row kernel."""
    import json

    tuned = {"BLOCK_N": 64, "BLOCK_K": 512, "SPLIT_K": 2, "num_warps": 8, "num_stages": 3}
    tiles = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 8, "num_stages": 3}
    table = tmp_path / "fp8.json"
    table.write_text(json.dumps({"_doc": "x", "N=4096,K=4096": {"1": {**tuned, "ms": 0.01},
                                                                "32": {"kernel": "scaled_mm", "ms": 0.02},
                                                                "256": {**tiles, "ms": 0.03}}}))
    monkeypatch.setattr(triton_fp8, "_config_table", TileTable(str(table)))
    try:
        assert triton_fp8.decode_config(1, 4096, 4096) == tuned
        assert triton_fp8.decode_config(2, 4096, 4096) is None and triton_fp8.decode_config(32, 4096, 4096) is None
        assert triton_fp8.decode_config(16, 1024, 4096) == triton_fp8.default_config(1024)
        assert triton_fp8.decode_config(17, 1024, 4096) is None and triton_fp8.decode_config(33, 1024, 4096) is None
        assert triton_fp8.decode_config(33, 4096, 4096) == tiles == triton_fp8.decode_config(256, 4096, 4096)
        assert triton_fp8.decode_config(triton_fp8.MAX_ROWS + 1, 4096, 4096) is None
    finally:
        monkeypatch.undo()
        triton_fp8.reload_config_table()
