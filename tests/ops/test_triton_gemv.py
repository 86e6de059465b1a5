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
    (70, 96, 128, 32, "dot", True),  # two row tiles of 64, the last partial
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
    x = torch.zeros(triton_gemv.MAX_ROWS + 1, 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="small_m_linear"):
        triton_gemv.small_m_linear(x, torch.zeros(8, 128, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 64"):
        triton_gemv.small_m_linear(x[:2, :100], torch.zeros(8, 100, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k, block_k, split_k, bias", [
    (8, 130, 512, 128, 3, False),  # 4 K tiles in 2 splits of 2
    (29, 80, 320, 64, 3, True),  # 5 tiles: splits of 2, 2, 1
    (1, 70, 256, 64, 4, True),  # one row in the dot kernel, a tile per split
    (16, 64, 192, 64, 8, False),  # more splits asked than tiles: one tile each
    (100, 80, 256, 64, 2, True),  # two row tiles of 64: each (row tile, column tile) counts apart
])
def test_split_k_equals_the_unsplit_kernel(triton_gemv, dtype, m, n, k, block_k, split_k, bias):
    """K split across programs: the partials meet in the last program of each column tile, which
    also resets its counter, so a second launch (another shape, another split) is right too."""
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    whole = triton_gemv.small_m_linear(x, w, b, block_n=32, block_k=block_k)
    for _ in range(2):
        parts = triton_gemv.small_m_linear(x, w, b, block_n=32, block_k=block_k, split_k=split_k)
        exact = x.double() @ w.double().T + (b.double() if bias else 0)
        assert _rel(parts, exact) < TOL[dtype] and _rel(parts, whole) < TOL[dtype] / 2
        # a different grid in between: the counters it uses must be back at 0 after it
        triton_gemv.small_m_linear(x[:3], w[:40], None, block_n=16, block_k=block_k, split_k=2)


def _spy(monkeypatch, triton_ops):
    calls = []
    real = triton_ops.small_m_linear
    monkeypatch.setattr(triton_ops, "small_m_linear", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    return calls


def test_linear_takes_the_tuned_table_entry_of_the_rows_bucket(triton_ops, triton_gemv, monkeypatch):
    """A tuned (N, K): each row count takes the smallest tuned bucket holding it; "cublas" sends the
    rows to F.linear; row tiles past 32 rows where the table has them; a shape the table lacks keeps
    the default rule."""
    n, k = 96, 256
    split = dict(kernel="dot", block_n=32, block_k=64, split_k=2, num_warps=4, num_stages=3)
    tiles = dict(kernel="dot", block_m=64, block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=3)
    table = {triton_gemv.config_key(n, k): {"4": {**split, "us": 1.0}, "32": {"kernel": "cublas", "us": 1.0},
                                            "128": {**tiles, "us": 1.0}}}
    monkeypatch.setattr(triton_gemv, "_config_table", lambda: table)
    calls = _spy(monkeypatch, triton_ops)
    w = (torch.randn(n, k) / k ** 0.5).to(DEVICE, torch.bfloat16)
    for m, expected in [(1, split), (3, split), (4, split), (5, None), (32, None), (100, tiles), (129, None)]:
        calls.clear()
        x = torch.randn(m, k).to(DEVICE, torch.bfloat16)
        assert _rel(triton_ops.linear(x, w), x.double() @ w.double().T) < TOL[torch.bfloat16]
        assert [{key: c[key] for key in expected} for c in calls] == ([expected] if expected else [])
    assert triton_gemv.decode_config(2, n, 128) == triton_gemv.default_config(2, n, 128)


@pytest.mark.parametrize("m, numel_big", [(1, False), (4, True), (4, False), (24, True), (33, True)])
def test_linear_dispatch(triton_ops, triton_gemv, monkeypatch, m, numel_big):
    """Untuned shapes (triton_ops.linear): 1 row on the one-row kernel, 2-16 rows on the dot kernel
    for weights of 4M elements and up (17-32 rows: 20M), anything else (and float32) on F.linear."""
    monkeypatch.setattr(triton_gemv, "_config_table", lambda: {})
    spied = _spy(monkeypatch, triton_ops)
    n, k = ((4096, 1024) if m <= 16 else (20480, 1024)) if numel_big else (64, 128)
    x = torch.randn(m, k).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k) / k ** 0.5).to(DEVICE, torch.bfloat16)
    y = triton_ops.linear(x, w)
    assert _rel(y, x.double() @ w.double().T) < TOL[torch.bfloat16]
    expected = {1: ["gemv"], 4: ["dot"] if numel_big else [], 24: ["dot"], 33: []}[m]
    assert [c["kernel"] for c in spied] == expected and all(c["split_k"] == 1 for c in spied)
    spied.clear()
    triton_ops.linear(x.float(), w.float())
    assert spied == []


def test_tuner_writes_the_table_that_linear_dispatches_from(triton_gemv, triton_ops, monkeypatch, tmp_path, capsys):
    """pagedllm.benchmarks.gemv_kernel --tune (two tilings, one of them split, on a tiny shape): one
    entry per projection and row bucket, each either cuBLAS or a candidate that ran; with a margin
    that always prefers Triton, linear() then runs exactly the tuned tiling of each bucket."""
    import json

    from pagedllm.benchmarks import gemv_kernel
    from pagedllm.ops.tile_tables import TileTable

    monkeypatch.setattr(gemv_kernel, "GRID", {"block_n": (32,), "block_k": (128,), "stages": ((4, 2),),
                                              "split_k": (1, 2)})
    monkeypatch.setattr(gemv_kernel, "GEMV_GRID", {"block_n": (8,), "stages": ((4, 2),)})
    path = tmp_path / "gemv.json"
    gemv_kernel.main(["--shape", "tiny-llama", "--projections", "qkv,o", "--rows", "1,4", "--tune", "--replays", "1",
                      "--margin=-1e9", "--config-out", str(path)])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["projection"], r["n"], r["k"], r["rows"], r["candidates"]) for r in rows] == [
        ("qkv", 512, 256, 1, 3), ("qkv", 512, 256, 4, 2), ("o", 256, 256, 1, 3), ("o", 256, 256, 4, 2)]
    table = json.loads(path.read_text())
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    assert set(table) == {"_doc", "_tuned_on", "N=512,K=256", "N=256,K=256"} and table["_tuned_on"] == {"1,4": gpu}
    monkeypatch.setattr(triton_gemv, "_config_table", TileTable(str(path)))
    spied = _spy(monkeypatch, triton_ops)
    for (n, k), m in [((512, 256), 1), ((256, 256), 3)]:
        entry = table[f"N={n},K={k}"]["1" if m == 1 else "4"]
        assert entry["kernel"] in ("gemv", "dot")
        assert entry["block_k"] == (256 if entry["kernel"] == "gemv" else 128)
        x = torch.randn(m, k).to(DEVICE, torch.bfloat16)
        w = (torch.randn(n, k) / k ** 0.5).to(DEVICE, torch.bfloat16)
        spied.clear()
        assert _rel(triton_ops.linear(x, w), x.double() @ w.double().T) < TOL[torch.bfloat16]
        assert spied == [{key: v for key, v in entry.items() if key != "us"} | {"lora": None}]
