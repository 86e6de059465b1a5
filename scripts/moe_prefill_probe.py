"""One MoE layer of a shape at prefill sizes: the fused kernel's time by kernel against the
dense cuBLAS GEMMs of the same FLOPs, and a few tile configs. The question it answers: how far
the grouped GEMMs are from what the GPU does on one dense GEMM.

python scripts/moe_prefill_probe.py [--tokens 2048,8192] [--configs]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm.benchmarks.moe_kernel import _time_ms
from pagedllm.ops import triton_fused_moe as tfm
from pagedllm.ops.fused_moe import route

CANDIDATES = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s) for bm, bn, bk, w, s in [
    (128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4),
    (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 8, 3)]]


def time_ms(fn) -> float:
    return _time_ms(fn, 10, "cuda")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--configs", action="store_true", help="time CANDIDATES too")
    args = p.parse_args()
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=dt, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=dt, generator=g) / i ** 0.5
    for t in map(int, args.tokens.split(",")):
        x = torch.randn(t, h, device="cuda", dtype=dt, generator=g)
        weights, ids = route(torch.randn(t, e, device="cuda", generator=g), k, renormalize=True)
        flops = 2 * t * k * 3 * h * i
        ms = time_ms(lambda: tfm.fused_experts_triton(x, w13, w2, weights, ids))
        a1 = torch.randn(t * k, h, device="cuda", dtype=dt)
        b1 = torch.randn(h, 2 * i, device="cuda", dtype=dt)
        a2 = torch.randn(t * k, i, device="cuda", dtype=dt)
        b2 = torch.randn(i, h, device="cuda", dtype=dt)
        dense = time_ms(lambda: (a1 @ b1, a2 @ b2))
        print(f"T={t}: fused {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), config {tfm.get_config(e, h, i, t, k)}; "
              f"dense cuBLAS same FLOPs {dense:.3f} ms ({flops / dense / 1e9:.0f} TFLOP/s)")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            tfm.fused_experts_triton(x, w13, w2, weights, ids)
            torch.cuda.synchronize()
        for ev in sorted(prof.key_averages(), key=lambda ev: -ev.self_device_time_total)[:8]:
            if ev.self_device_time_total > 0:
                print(f"    {ev.self_device_time_total / 1e3:8.3f} ms {ev.count:3d}x {ev.key[:90]}")
        if args.configs:
            for cfg in CANDIDATES:
                try:
                    c_ms = time_ms(lambda: tfm.fused_experts_triton(x, w13, w2, weights, ids, config=cfg))
                    print(f"    {c_ms:.3f} ms {cfg}")
                except Exception as ex:  # noqa: BLE001 - out of shared memory: skipped
                    print(f"    skip {cfg}: {type(ex).__name__}")


if __name__ == "__main__":
    main()
