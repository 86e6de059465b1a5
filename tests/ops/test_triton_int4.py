"""The W4A16 Triton GEMM equals the torch dequantize-then-matmul path (pagedllm.model.quantization.int4):
decode rows 1..32 (small-row tiling) and prefill sizes, K of 3..12 groups (not a multiple of the
64-wide tile: 96, 160), groups of 32/64/128 with tiles never straddling a group, N not a
multiple of the tile, zero points or none, bias or none, bf16 and fp16. ‖out − ref‖/‖ref‖
against the float64 product of the same dequantized weight (one rounding of an fp32
accumulation: 1e-2 bf16, 2e-3 fp16)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.model.quantization.int4 import dequantize, pack_cols, pack_rows
from pagedllm.ops.tile_tables import TileTable
from tests.ops.conftest import DEVICE

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _weights(n, k, group, zp, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (k // group, n), generator=g) if zp else None
    return (pack_rows(q).to(DEVICE), scales.to(DEVICE), None if zeros is None else pack_cols(zeros).to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k, group, zp, bias", [
    (1, 40, 96, 32, True, False),
    (1, 136, 256, 128, False, True),
    (3, 64, 160, 32, False, False),
    (16, 48, 192, 64, True, True),
    (17, 40, 128, 64, False, False),
    (32, 72, 256, 128, True, False),
    (45, 136, 96, 32, True, True),
    (130, 200, 384, 128, True, False),
])
def test_w4a16_kernel_matches_dequantized_matmul(triton_int4, dtype, m, n, k, group, zp, bias):
    qweight, scales, qzeros = _weights(n, k, group, zp, dtype, seed=m * 7 + n)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    y = triton_int4.w4a16_linear(x, qweight, scales, qzeros, group, b)
    w = dequantize(qweight, scales, qzeros, group, k, dtype)  # [K, N], rounded as the kernel rounds it
    exact = x.double() @ w.double() + (b.double() if bias else 0)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y, exact) < TOL[dtype]


@pytest.mark.parametrize("m, tiles", [(1, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)),
                                      (40, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128))])
def test_packed_load_variant_matches(triton_int4, m, tiles):
    """The variant that loads each word once and spreads its eight values by a reshape."""
    qweight, scales, qzeros = _weights(96, 256, 128, True, torch.bfloat16, seed=m)
    x = torch.randn(m, 256).to(DEVICE, torch.bfloat16)
    want = triton_int4.w4a16_linear(x, qweight, scales, qzeros, 128, **tiles)
    got = triton_int4.w4a16_linear(x, qweight, scales, qzeros, 128, PACKED_LOAD=True, **tiles)
    assert torch.equal(got, want)


def test_tilings_and_refusals(triton_int4):
    assert triton_int4.tiles_for(1, 4096, 128)["BLOCK_M"] == 16 and triton_int4.tiles_for(20, 4096, 32)["BLOCK_M"] == 32
    assert triton_int4.tiles_for(33, 4096, 128)["BLOCK_M"] == 64
    for group in (32, 64, 128):
        assert group % triton_int4.tiles_for(1, 64, group)["BLOCK_K"] == 0
    qweight, scales, qzeros = _weights(16, 64, 32, True, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="w4a16_linear"):
        triton_int4.w4a16_linear(torch.zeros(2, 72, dtype=torch.bfloat16, device=DEVICE), qweight, scales, qzeros, 32)


@pytest.mark.parametrize("k, n, group, zp", [(96, 40, 32, True), (256, 136, 128, False), (192, 200, 64, True)])
def test_dequantize_kernel_equals_torch_dequantize(triton_int4, k, n, group, zp):
    qweight, scales, qzeros = _weights(n, k, group, zp, torch.bfloat16, seed=k + n)
    w = triton_int4.w4a16_dequantize(qweight, scales, qzeros, group, torch.bfloat16)
    assert torch.equal(w, dequantize(qweight, scales, qzeros, group, k, torch.bfloat16))


def test_large_prefill_takes_the_dequantize_path(triton_int4, monkeypatch):
    monkeypatch.setattr(triton_int4, "DEQUANT_ROWS", 40)
    qweight, scales, qzeros = _weights(48, 64, 32, True, torch.bfloat16, seed=1)
    x = torch.randn(40, 64).to(DEVICE, torch.bfloat16)
    b = torch.randn(48).to(DEVICE, torch.bfloat16)
    y = triton_int4.w4a16_linear(x, qweight, scales, qzeros, 32, b)
    exact = x.double() @ dequantize(qweight, scales, qzeros, 32, 64, torch.bfloat16).double() + b.double()
    assert _rel(y, exact) < TOL[torch.bfloat16]


@pytest.mark.parametrize("m", [1, 20, 70])
def test_gguf_q4_1_mins_variant(triton_int4, monkeypatch, m):
    """GGUF Q4_1: ``w = q * s + m`` with a float min per group of 32 (the GEMM and the dequantize-
    then-cuBLAS path)."""
    qweight, scales, _ = _weights(48, 96, 32, False, torch.float16, seed=m)
    mins = (torch.randn(3, 48) * 0.01).to(DEVICE, torch.float16)
    x = torch.randn(m, 96).to(DEVICE, torch.bfloat16)
    w = dequantize(qweight, scales, None, 32, 96, torch.bfloat16, mins)
    monkeypatch.setattr(triton_int4, "DEQUANT_ROWS", 64)
    y = triton_int4.w4a16_linear(x, qweight, scales, None, 32, mins=mins)
    assert _rel(y, x.double() @ w.double()) < TOL[torch.bfloat16]
    assert torch.equal(triton_int4.w4a16_dequantize(qweight, scales, None, 32, torch.bfloat16, mins), w)


# ---- the split-K decode kernel (row tiles beyond 32 rows) -----------------------------------------

@pytest.mark.parametrize("m, n, k, group, zp, dot, split, dtype", [
    (1, 40, 384, 128, True, True, 3, torch.bfloat16),    # 3 groups, one per split; N under one tile
    (1, 136, 512, 128, False, False, 4, torch.float16),  # FMA, N not a multiple of the tile
    (3, 72, 256, 64, True, False, 3, torch.bfloat16),    # FMA rows padded to 4; 4 tiles over 3 splits
    (3, 200, 384, 128, False, True, 2, torch.float16),
    (16, 72, 512, 128, True, True, 3, torch.bfloat16),
    (32, 136, 256, 128, True, True, 1, torch.bfloat16),  # one split: the direct store
    (32, 40, 384, 128, False, True, 3, torch.float16),
    (2, 48, 96, 32, True, False, 2, torch.bfloat16),     # groups of 32
    (40, 72, 384, 128, True, True, 3, torch.bfloat16),   # row tiles: 40 rows in tiles of 16, split
    (70, 136, 256, 128, False, True, 1, torch.float16),  # 70 rows in tiles of 16, the direct store
])
def test_splitk_decode_kernel_matches_dequantized_matmul(triton_int4, m, n, k, group, zp, dot, split, dtype):
    qweight, scales, qzeros = _weights(n, k, group, zp, dtype, seed=m * 5 + k)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    config = dict(BLOCK_M=(16 if m <= 16 or m > 32 else 32) if dot else 1 << (m - 1).bit_length(), BLOCK_N=64,
                  BLOCK_K=min(group, 128), USE_DOT=dot, SPLIT_K=split, num_warps=4, num_stages=2)
    y = triton_int4.w4a16_splitk(x, qweight, scales, qzeros, group, b, config=config)
    w = dequantize(qweight, scales, qzeros, group, k, dtype)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y, x.double() @ w.double() + b.double()) < TOL[dtype]
    # The last program of each column tile reduced in split order and reset its counter.
    again = triton_int4.w4a16_splitk(x, qweight, scales, qzeros, group, b, config=config)
    assert torch.equal(again, y)
    if split > 1:
        from pagedllm.ops import triton_splitk

        assert int(triton_splitk._COUNTERS[y.device, "gemm"].abs().sum()) == 0


def test_splitk_gguf_q4_1_mins(triton_int4):
    qweight, scales, _ = _weights(48, 96, 32, False, torch.float16, seed=3)
    mins = (torch.randn(3, 48) * 0.01).to(DEVICE, torch.float16)
    x = torch.randn(2, 96).to(DEVICE, torch.bfloat16)
    w = dequantize(qweight, scales, None, 32, 96, torch.bfloat16, mins)
    y = triton_int4.w4a16_linear(x, qweight, scales, None, 32, mins=mins)  # the default: FMA, groups of 32
    assert _rel(y, x.double() @ w.double()) < TOL[torch.bfloat16]


def test_decode_dispatch_reads_the_tuning_table(triton_int4, monkeypatch, tmp_path):
    # Defaults (an empty table: the committed one holds the H100's llama3-8b shapes): the dot at
    # group 128 (any row count up to 32), FMA for small groups at a few rows, the tiled kernel
    # otherwise; about three programs per SM.
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    monkeypatch.setattr(triton_int4, "_config_table", TileTable(str(empty)))
    c = triton_int4.decode_config(1, 4096, 4096, 128, "cpu")
    assert c["USE_DOT"] and c["BLOCK_M"] == 16 and triton_int4.triton.cdiv(4096, c["BLOCK_N"]) * c["SPLIT_K"] >= 240
    assert triton_int4.decode_config(20, 4096, 4096, 128, "cpu")["BLOCK_M"] == 32
    assert not triton_int4.decode_config(3, 4096, 4096, 64, "cpu")["USE_DOT"]
    assert triton_int4.decode_config(8, 4096, 4096, 64, "cpu") is None
    assert triton_int4.decode_config(33, 4096, 4096, 128, "cpu") is None
    for m, n, k in [(1, 6144, 4096), (1, 4096, 14336), (32, 28672, 4096), (16, 4096, 4096)]:
        c = triton_int4.default_splitk_config(m, n, k, 128)
        assert 2 * 4 * c["SPLIT_K"] * m * n <= n * k // 2 // 4 or c["SPLIT_K"] == 1
        assert triton_int4.triton.cdiv(n, c["BLOCK_N"]) * c["SPLIT_K"] >= 132  # every SM has a program
    table = {"N=96,K=256,G=128": {"1": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, USE_DOT=True, SPLIT_K=2,
                                            num_warps=4, num_stages=2, ms=0.01),
                                  "8": {"kernel": "tiled"}},
             "N=160,K=256,G=128": {"128": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, USE_DOT=True, SPLIT_K=1,
                                               num_warps=4, num_stages=2, ms=0.02)}}
    path = tmp_path / "w4a16_configs.json"
    path.write_text(__import__("json").dumps(table))
    monkeypatch.setattr(triton_int4, "_config_table", TileTable(str(path)))
    try:
        assert triton_int4.decode_config(1, 96, 256, 128)["BLOCK_N"] == 32
        assert triton_int4.decode_config(5, 96, 256, 128) is None  # bucket 8: the tiled kernel won
        assert triton_int4.decode_config(9, 96, 256, 128, "cpu")["BLOCK_M"] == 16  # no bucket from 9 up: default
        assert triton_int4.decode_config(9, 96, 256, 128, "cpu")["BLOCK_N"] == 64  # (the table says 32)
        assert triton_int4.decode_config(100, 160, 256, 128)["BLOCK_M"] == 64  # a wide bucket: row tiles
        assert triton_int4.decode_config(100, 160, 256, 128, zero_points=True)["BLOCK_M"] == 32
        assert triton_int4.decode_config(129, 160, 256, 128) is None  # beyond the tuned buckets: tiled
        qweight, scales, qzeros = _weights(96, 256, 128, True, torch.bfloat16, seed=9)
        calls = []
        original = triton_int4.w4a16_splitk
        monkeypatch.setattr(triton_int4, "w4a16_splitk", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
        _check_dispatched(triton_int4, (1, 5), qweight, scales, qzeros)
        assert len(calls) == 1
    finally:
        monkeypatch.undo()  # the committed table's path back, then its contents
        triton_int4.reload_config_table()


def test_table_dequant_entries_take_the_dequantize_path(triton_int4, monkeypatch, tmp_path):
    """A bucket where the sweep found dequantize-then-cuBLAS fastest takes it, and so does any row
    count past the widest bucket when that bucket did; below the widest, the next bucket up rules."""
    table = {"N=96,K=256,G=128": {"64": {"kernel": "dequant", "ms": 0.01},
                                  "512": {"kernel": "dequant", "ms": 0.02}},
             "N=160,K=256,G=128": {"512": {"kernel": "tiled", "ms": 0.02}}}
    path = tmp_path / "w4a16_configs.json"
    path.write_text(__import__("json").dumps(table))
    monkeypatch.setattr(triton_int4, "_config_table", TileTable(str(path)))
    try:
        assert triton_int4.decode_config(40, 96, 256, 128) is triton_int4.DEQUANT
        assert triton_int4.decode_config(600, 96, 256, 128) is triton_int4.DEQUANT
        assert triton_int4.decode_config(600, 160, 256, 128) is None
        assert triton_int4.decode_config(100, 160, 256, 128) is None  # only 512 tuned there: tiled
        qweight, scales, qzeros = _weights(96, 256, 128, True, torch.bfloat16, seed=4)
        calls = []
        original = triton_int4.w4a16_dequantize
        monkeypatch.setattr(triton_int4, "w4a16_dequantize", lambda *a, **kw: calls.append(a) or original(*a, **kw))
        monkeypatch.setattr(triton_int4, "w4a16_splitk", None)  # never reached
        # The smallest tuned bucket holding m rows (64, 64), then past the widest.
        _check_dispatched(triton_int4, (3, 40, 600), qweight, scales, qzeros)
        assert len(calls) == 3
    finally:
        monkeypatch.undo()
        triton_int4.reload_config_table()


def _check_dispatched(triton_int4, rows, qweight, scales, qzeros):
    """w4a16_linear at each row count (K 256, groups of 128, as the table dispatches) against the
    dequantized weight in float64."""
    for m in rows:
        x = torch.randn(m, 256).to(DEVICE, torch.bfloat16)
        y = triton_int4.w4a16_linear(x, qweight, scales, qzeros, 128)
        exact = x.double() @ dequantize(qweight, scales, qzeros, 128, 256, torch.bfloat16).double()
        assert _rel(y, exact) < TOL[torch.bfloat16]


# ---- the transposed split-K kernel (triton_int4_swap: weights as the dot's left operand) ------------

@pytest.mark.parametrize("m, n, k, zp, bias, split, block_m, dtype", [
    (1, 72, 384, False, True, 3, 16, torch.bfloat16),    # one row; N under two tiles; 3 groups, 3 splits
    (5, 136, 256, True, False, 1, 16, torch.float16),    # zero points; one split: the direct store
    (16, 64, 512, True, True, 4, 16, torch.bfloat16),    # zero points, bias, 4 splits
    (32, 200, 384, False, False, 2, 32, torch.float16),  # 3 K tiles over 2 splits (2 + 1)
    (40, 72, 256, True, False, 2, 16, torch.bfloat16),   # row tiles: 40 rows in tiles of 16
])
def test_swapped_splitk_kernel_matches_dequantized_matmul(triton_int4, monkeypatch, m, n, k, zp, bias, split, block_m,
                                                          dtype):
    qweight, scales, qzeros = _weights(n, k, 128, zp, dtype, seed=m * 7 + n)
    g = torch.Generator().manual_seed(k + m)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    config = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, USE_DOT=True, SWAP=True, SPLIT_K=split, num_warps=4,
                  num_stages=2)
    calls = []
    swap = triton_int4.w4a16_swap_splitk
    monkeypatch.setattr(triton_int4, "w4a16_swap_splitk", lambda *a: calls.append(a[-2]) or swap(*a))
    y = triton_int4.w4a16_linear(x, qweight, scales, qzeros, 128, b, decode=config)
    again = triton_int4.w4a16_linear(x, qweight, scales, qzeros, 128, b, decode=config)
    assert len(calls) == 2 and calls[0]["SPLIT_K"] == split  # the transposed kernel ran
    ref = x.double() @ dequantize(qweight, scales, qzeros, 128, k, dtype).double()
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y, ref if b is None else ref + b.double()) < TOL[dtype]
    assert torch.equal(again, y)  # the split's sum in split order, counters reset
    # The same numbers as the untransposed kernel, to the rounding of the output.
    plain = triton_int4.w4a16_splitk(x, qweight, scales, qzeros, 128, b, config={**config, "SWAP": False})
    assert _rel(y, plain) < 2 * TOL[dtype] / 10


def test_swapped_configs_fall_back_where_they_do_not_fit(triton_int4):
    """A SWAP entry needs 128-deep K tiles in one group, 64+ features and 16+ rows a program; GGUF Q4_1's
    mins take the untransposed kernel."""
    base = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, USE_DOT=True, SWAP=True, SPLIT_K=1, num_warps=4, num_stages=2)
    assert triton_int4.splitk_eligible(1, 128, base)
    assert not triton_int4.splitk_eligible(1, 64, {**base, "BLOCK_K": 64})
    assert not triton_int4.splitk_eligible(1, 128, {**base, "BLOCK_N": 32})
    with pytest.raises(ValueError, match="BLOCK_N"):
        triton_int4.w4a16_swap_splitk(torch.zeros(1, 128).to(DEVICE, torch.bfloat16), None, None, None, 128, None,
                                      {**base, "BLOCK_N": 32}, None)
    qweight, scales, _ = _weights(64, 256, 128, False, torch.bfloat16, seed=1)
    mins = (torch.randn(2, 64) * 0.01).to(DEVICE, torch.bfloat16)
    x = torch.randn(2, 256).to(DEVICE, torch.bfloat16)
    y = triton_int4.w4a16_splitk(x, qweight, scales, None, 128, mins=mins, config=base)
    w = dequantize(qweight, scales, None, 128, 256, torch.bfloat16, mins)
    assert _rel(y, x.double() @ w.double()) < TOL[torch.bfloat16]


def test_the_layer_chain_launches_early_only_up_to_the_models_row_limit(monkeypatch):
    """``triton_pdl.decode_pdl``: with early launch on (faked here: it needs Hopper), a launch of more
    rows than the model's limit (W4A16: CHAIN_PDL_MAX_ROWS) runs in stream order; without a limit, or
    a launch that names no rows, early."""
    from pagedllm.model.quantization.int4 import CHAIN_PDL_MAX_ROWS
    from pagedllm.ops import triton_pdl

    monkeypatch.setattr(triton_pdl, "pdl_enabled", lambda device, switch: switch == "PAGEDLLM_DECODE_PDL")
    monkeypatch.setattr(triton_pdl, "_CHAIN_MAX_ROWS", None)
    dev = torch.device("cpu")
    triton_pdl.set_chain_max_rows(CHAIN_PDL_MAX_ROWS)
    assert triton_pdl.decode_pdl(dev, CHAIN_PDL_MAX_ROWS) and triton_pdl.decode_pdl(dev)
    assert not triton_pdl.decode_pdl(dev, CHAIN_PDL_MAX_ROWS + 1)
    assert triton_pdl.enter_args(dev, 32) == {"ENTER": False}
    assert triton_pdl.enter_args(dev, 8) == {"ENTER": True, "launch_pdl": True}
    triton_pdl.set_chain_max_rows(None)
    assert triton_pdl.decode_pdl(dev, 4096)
