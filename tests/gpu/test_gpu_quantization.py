"""GPU-only (issue 17): the quantized paths that only run on CUDA, against the CPU/torch paths the
CPU suite pins to fp32 references. Skipped without CUDA.

- the fp8 activation-quantization kernel equals the torch quantizers bit for bit (Triton's
  interpreter rounds float32 -> fp8 wrongly, so this cannot run on CPU);
- ``torch._scaled_mm`` (row-wise, sm89+), the Triton small-row fp8 kernel and the Triton
  block-scaled GEMM equal the float32 products of the same fp8 operands (‖Δ‖/‖ref‖ < 1e-2 in
  bfloat16);
- the W4A16 kernel at llama3-8b projection shapes, rows 1..32 and prefill;
- every checkpoint format end to end in bfloat16 with CUDA graphs: each prompt's first greedy
  token equals the fp32 CPU engine's, logprobs within 0.1 (bfloat16 activations).
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.model.quantization.fp8 import (
    FP8_DTYPE, block_scales_to_elements, fp8_block_linear, fp8_linear, quantize_per_token,
    quantize_per_token_group, quantize_static,
)
from pagedllm.model.quantization.int4 import dequantize, int4_linear, pack_cols, pack_rows
from tests.model import quant_checkpoints as qc
from tests.model.test_quantization import FP8_CASES, INT4_CASES, MAX_TOKENS, engine_greedy, make_llm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FP8_MMA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m, k", [(1, 4096), (7, 14336), (300, 1024)])
def test_activation_quant_kernel_equals_torch(m, k):
    from pagedllm.ops.triton_fp8 import quantize_fp8

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x[0, :] = 0  # an all-zero row takes the floor scale
    q, s = quantize_fp8(x)
    rq, rs = quantize_per_token(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    q, s = quantize_fp8(x, 128)
    rq, rs = quantize_per_token_group(x, 128)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    static = torch.tensor(0.01, device="cuda")
    q, s = quantize_fp8(x, static_scale=static)
    assert torch.equal(q.view(torch.uint8), quantize_static(x, static).view(torch.uint8)) and s.shape == (m, 1)


@pytest.mark.skipif(not FP8_MMA, reason="needs fp8 tensor cores (sm89+)")
@pytest.mark.parametrize("m", [1, 16, 33, 512])
@pytest.mark.parametrize("act", ["dynamic", "static"])
@pytest.mark.parametrize("decode", [False, None, "split"])  # _scaled_mm for every batch; the table; K split 5 ways
def test_scaled_mm_and_small_row_paths_equal_float32_products(m, act, decode):
    if decode == "split":
        decode = dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=5, num_warps=4, num_stages=4)
    n, k = 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(FP8_DTYPE)
    ws = torch.rand(n, device="cuda") * 0.001 + 1e-4
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    inp = torch.tensor(0.02, device="cuda")
    y = fp8_linear(x, w, ws, b, act, inp, decode=decode)
    ref = fp8_linear(x.cpu(), w.cpu(), ws.cpu(), b.cpu(), act, inp.cpu())  # float32 math on CPU
    assert y.dtype == torch.bfloat16 and _rel(y.cpu(), ref) < 1e-2


@pytest.mark.skipif(not FP8_MMA, reason="needs fp8 tensor cores (sm89+)")
@pytest.mark.parametrize("m", [1, 32, 200])
def test_block_fp8_kernel_equals_float32_products(m):
    n, k = 1536, 7168  # a DeepSeek-V3 projection's shape (scaled)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(FP8_DTYPE)
    ws = torch.rand(n // 128, k // 128, device="cuda") * 0.001 + 1e-4
    y = fp8_block_linear(x, w, ws, None, (128, 128))
    xq, xs = quantize_per_token_group(x.cpu(), 128)
    ref = (xq.float() * xs.repeat_interleave(128, 1)) @ (w.cpu().float()
                                                          * block_scales_to_elements(ws.cpu(), n, k, 128, 128)).t()
    assert _rel(y.cpu(), ref) < 1e-2


@pytest.mark.parametrize("m", [1, 4, 17, 32, 256])
@pytest.mark.parametrize("n, k, group, zp", [(4096, 4096, 128, True), (28672, 4096, 128, False),
                                             (4096, 14336, 64, True), (1024, 4096, 32, False)])
def test_w4a16_kernel_at_llama_shapes(m, n, k, group, zp):
    g = torch.Generator(device="cuda").manual_seed(m)
    q = torch.randint(0, 16, (k, n), device="cuda", generator=g)
    scales = (torch.rand(k // group, n, device="cuda", generator=g) * 0.01).to(torch.bfloat16)
    zeros = pack_cols(torch.randint(0, 16, (k // group, n), device="cuda", generator=g)) if zp else None
    qweight = pack_rows(q)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    y = int4_linear(x, qweight, scales, zeros, group, None)
    ref = x.double() @ dequantize(qweight, scales, zeros, group, k, torch.bfloat16).double()
    assert _rel(y, ref) < 1e-2


@pytest.mark.parametrize("m", [1, 3, 8, 32])
def test_w4a16_splitk_in_a_cuda_graph_is_deterministic(m):
    """The split-K decode kernel captured in a graph: every config the tuning sweep may pick (dot,
    transposed dot and FMA, several splits), replayed with new inputs, equals its eager result bit for bit (the
    fixed-order reduction) and the reference; the counters are back to zero after each replay."""
    from pagedllm.ops import triton_int4

    n, k, group = 6144, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(m)
    qweight = pack_rows(torch.randint(0, 16, (k, n), device="cuda", generator=g))
    scales = (torch.rand(k // group, n, device="cuda", generator=g) * 0.01).to(torch.float16)
    w = dequantize(qweight, scales, None, group, k, torch.bfloat16).double()
    configs = [triton_int4.decode_config(m, n, k, group),
               dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=64, BLOCK_K=128, USE_DOT=True, SPLIT_K=8, num_warps=4,
                    num_stages=3),
               dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=128, BLOCK_K=128, USE_DOT=True, SWAP=True, SPLIT_K=4,
                    num_warps=4, num_stages=4)]  # the transposed kernel (triton_int4_swap)
    if m <= 4:
        configs.append(dict(BLOCK_M=1 << (m - 1).bit_length(), BLOCK_N=128, BLOCK_K=128, USE_DOT=False, SPLIT_K=5,
                            num_warps=4, num_stages=2))
    for config in configs:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        triton_int4.w4a16_linear(x, qweight, scales, None, group, decode=config)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = triton_int4.w4a16_linear(x, qweight, scales, None, group, decode=config)
        for _ in range(3):
            x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g))
            graph.replay()
            eager = triton_int4.w4a16_linear(x, qweight, scales, None, group, decode=config)
            torch.cuda.synchronize()
            assert torch.equal(y, eager), config
            assert _rel(y, x.double() @ w) < 1e-2, config
        from pagedllm.ops import triton_splitk

        assert int(triton_splitk._COUNTERS[y.device, "gemm"].abs().sum()) == 0


@pytest.mark.parametrize("case", sorted(INT4_CASES) + sorted(FP8_CASES))
def test_quantized_checkpoints_on_gpu_match_the_cpu_engine(tmp_path, case):
    (INT4_CASES.get(case) or FP8_CASES[case])(str(tmp_path))
    cpu_ids, cpu_lps = engine_greedy(make_llm(str(tmp_path)))
    from pagedllm import LLM

    llm = LLM(str(tmp_path), dtype="bfloat16", seed=0, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20,
              device="cuda")
    assert llm.llm_engine.engine_core.executor.worker.model_runner.cuda_graphs
    ids, lps = engine_greedy(llm)
    same = [g[0] == w[0] for g, w in zip(ids, cpu_ids)]
    if case in FP8_CASES:  # bf16 activations here, fp32 on CPU: an fp8 rounding boundary may flip a token
        assert sum(same) >= len(same) - 1
    else:
        assert all(same)
    for got, want, s in zip(lps, cpu_lps, same):
        if s:
            assert got[0] == pytest.approx(want[0], abs=0.1)


def test_online_fp8_on_gpu_keeps_fp8_weights(tmp_path):
    qc.write_dense(str(tmp_path))
    from pagedllm import LLM

    llm = LLM(str(tmp_path), dtype="bfloat16", seed=0, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20,
              device="cuda", quantization="fp8")
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    ids, _ = engine_greedy(llm)
    assert all(len(i) == MAX_TOKENS for i in ids)
