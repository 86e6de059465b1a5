"""torch._scaled_mm (row-wise fp8, with and without fast accumulation; per-tensor plus an epilogue)
against bf16 F.linear at llama3-8b's four projections, by row count: µs per call (CUDA events, 30
calls over four weight copies), TFLOP/s and each fp8 variant's relative error against the exact
products of the quantized operands. Issue 17, stop 52 (why fp8 decode batches of 64-256 rows got
the small-row kernel's row tiles, and why _scaled_mm runs with fast accumulation).

python scripts/fp8_scaled_mm_probe.py [ROWS, comma-separated]
"""
import itertools
import sys

import torch

torch.manual_seed(0)
dev, f8 = "cuda", torch.float8_e4m3fn
shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
rows = [int(m) for m in sys.argv[1].split(",")] if len(sys.argv) > 1 else [64, 128, 256, 512, 1024, 2048, 4096, 8192]
one = torch.ones((), device=dev)


def timeit(fn, iters=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


print(f"{'proj':8s} {'M':>5s} | bf16  rowwise rowfast tens+ep tensfast | TF/s row fast bf16 | err row fast tens+ep")
for (name, (n, k)), m in itertools.product(shapes.items(), rows):
    w = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    ws = [t.abs().amax(1).float() / 448 for t in w]
    wq = [(t / s[:, None]).to(f8) for t, s in zip(w, ws)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    xs = x.abs().amax(1, keepdim=True).float() / 448
    xq = (x / xs).to(f8)
    turn = itertools.cycle(range(4))
    ref = (xq.float() * xs) @ (wq[0].float() * ws[0][:, None]).t()

    def rowwise(j=None, fast=False):
        j = next(turn) if j is None else j
        return torch._scaled_mm(xq, wq[j].t(), scale_a=xs, scale_b=ws[j].view(1, -1), out_dtype=torch.bfloat16,
                                use_fast_accum=fast)

    def tensorwise(j=None, fast=False):
        j = next(turn) if j is None else j
        y = torch._scaled_mm(xq, wq[j].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)
        return (y * xs * ws[j].view(1, -1)).to(torch.bfloat16)

    us = {"bf16": timeit(lambda: torch.nn.functional.linear(x, w[next(turn)])),
          "row": timeit(rowwise), "rowfast": timeit(lambda: rowwise(fast=True)),
          "tens": timeit(tensorwise), "tensfast": timeit(lambda: tensorwise(fast=True))}
    err = [((fn().float() - ref).norm() / ref.norm()).item()
           for fn in (lambda: rowwise(0), lambda: rowwise(0, True), lambda: tensorwise(0))]
    tf = 2 * m * n * k / 1e6
    print(f"{name:8s} {m:5d} | " + " ".join(f"{v:7.1f}" for v in us.values())
          + f" | {tf / us['row']:5.0f} {tf / us['rowfast']:5.0f} {tf / us['bf16']:5.0f} | "
          + " ".join(f"{e:.1e}" for e in err))
