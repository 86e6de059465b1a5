"""SmolLM2-135M's projections on CPU at M rows: F.linear (MKL sgemm in float32) against oneDNN
(torch.ops.mkldnn._linear_pointwise) on the plain weight and on a prepacked one; median ms per
call and per decode step (30 layers + LM head). Usage: python scripts/cpu_linear_bench.py [M]."""
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (in, out): qkv, o, gate_up, down, head


def bench(fn, n=40) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def main() -> None:
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    torch.manual_seed(0)
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    for dt in (torch.float32, torch.bfloat16) if bf16 else (torch.float32,):  # oneDNN bf16: AVX-512 or AMX
        per_step: dict[str, float] = {}
        for k, n in SHAPES:
            x, w = torch.randn(m, k, dtype=dt), torch.randn(n, k, dtype=dt)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            row = {"F.linear": bench(lambda: F.linear(x, w)),
                   "onednn": bench(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")),
                   "onednn_packed": bench(
                       lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], ""))}
            print(dt, m, k, n, {a: round(b, 3) for a, b in row.items()})
            for a, b in row.items():
                per_step[a] = per_step.get(a, 0.0) + b * (1 if n == 49152 else 30)
        print(dt, f"M={m} threads={torch.get_num_threads()} ms per step:", {a: round(b, 1) for a, b in per_step.items()})


if __name__ == "__main__":
    main()
