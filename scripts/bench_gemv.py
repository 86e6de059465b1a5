"""Small-row GEMM: cuBLAS (F.linear) against the Triton kernels of pagedllm.ops.triton_gemv,
per projection shape, timed as in a decode graph: 32 calls over rotating weight copies (more
bytes than L2) captured in one CUDA graph, time per call = replay time / 32.

python scripts/bench_gemv.py [--rows 1,8] [--shapes "8b o,30b-a3b qkv"]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from pagedllm.ops.triton_gemv import small_m_linear

SHAPES = {  # name: (N, K)
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
    "8b lm_head": (128256, 4096), "0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024),
    "0.6b down": (1024, 3072), "30b-a3b qkv": (5120, 2048), "30b-a3b o": (2048, 4096),
}


def time_per_call(fn, xs, ws, calls=32, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(xs[i % len(xs)], ws[i % len(ws)])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(xs[i % len(xs)], ws[i % len(ws)])
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,8,16,32")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    args = p.parse_args()
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    rows_list = [int(r) for r in args.rows.split(",")]
    configs = [dict(kernel="dot", block_n=bn, block_k=bk, num_warps=4, num_stages=st)
               for bn, bk, st in itertools.product((16, 32, 64), (128, 256), (3, 4, 5))]
    configs += [dict(kernel="gemv", block_n=bn, block_k=512, num_warps=4, num_stages=st)
                for bn, st in itertools.product((8, 16), (2, 3))]
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    bw = []
    for _ in range(5):
        dst = torch.empty_like(src)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        bw.append(2 * src.numel() / (a.elapsed_time(b) / 1e3))
    del dst, src
    copy_bw = sorted(bw)[2]
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    best_cfgs = {}
    for name, (n, k) in shapes.items():
        nbytes = n * k * 2
        copies = max(2, min(8, (400 << 20) // nbytes + 1))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        for m in rows_list:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            ref = F.linear(xs[0], ws[0])
            t_cublas = time_per_call(lambda x, w: F.linear(x, w), xs, ws)
            results = []
            for cfg in configs:
                if cfg["kernel"] == "gemv" and m != 1:
                    continue
                if k % cfg["block_k"]:
                    continue
                try:
                    y = small_m_linear(xs[0], ws[0], **cfg)
                    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                    if err > 1e-2:
                        print(f"  WRONG {name} m={m} {cfg}: rel err {err:.2e}")
                        continue
                    results.append((time_per_call(lambda x, w, c=cfg: small_m_linear(x, w, **c), xs, ws), cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                    print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:100]}")
            results.sort(key=lambda r: r[0])
            t_best, cfg = results[0]
            best_cfgs[(name, m)] = cfg
            print(f"{name:12s} m={m:2d} {nbytes / 2**20:7.1f} MiB  cuBLAS {t_cublas:7.2f} us "
                  f"({nbytes / (t_cublas * 1e-6) / copy_bw:.0%})  triton best {t_best:7.2f} us "
                  f"({nbytes / (t_best * 1e-6) / copy_bw:.0%}) {cfg}")
            for t, c in results[1:3]:
                print(f"{'':30s} next {t:7.2f} us {c}")
        del ws


if __name__ == "__main__":
    main()
