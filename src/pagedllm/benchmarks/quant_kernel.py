"""The quantized linear kernels alone, at a shape's projections (default llama3-8b: qkv 6144 x 4096,
o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336) and 1, 16, 32, 256 and 4096 rows:
the dense bf16 linear (the engine's: small-row Triton kernels or cuBLAS), W4A16 (Triton, groups of
128, symmetric), FP8 W8A8 per channel (activation quantization + the small-row kernel or
``torch._scaled_mm``) and block-wise FP8 (128 x 128). One JSON line per (projection, rows): the
median time of each (CUDA events), and for each the bytes of weights (and scales) it reads over
that time as a fraction of the measured device copy bandwidth (the decode roofline: at a few rows
a projection can only be as fast as reading its weight).

--tune times a grid of W4A16 tilings (tile sizes, warps, stages, the packed-load variant) per row
count and reports the fastest, to put into ``pagedllm.ops.triton_int4.tiles_for``. --tiny runs a
small shape on the CPU (the torch paths only) as a smoke test.
"""
from __future__ import annotations

import argparse
import itertools

from pagedllm.benchmarks.common import SHAPES, emit, int_list, print_table
from pagedllm.benchmarks.moe_kernel import _time_ms

TUNE_GRID = {"BLOCK_N": (16, 32, 64, 128), "BLOCK_K": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4),
             "PACKED_LOAD": (False, True)}


def projections(shape: dict) -> dict[str, tuple[int, int]]:
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape.get("num_key_value_heads", shape["num_attention_heads"])
    head_dim = shape.get("head_dim") or hidden // heads
    return {"qkv": ((heads + 2 * kv) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def _tune_w4a16(x, qweight, scales, group: int, iters: int, device: str) -> tuple[dict | None, float]:
    from pagedllm.ops.triton_int4 import tiles_for, w4a16_linear

    block_m = tiles_for(x.shape[0], qweight.shape[1], group)["BLOCK_M"]
    best, best_ms = None, float("inf")
    for values in itertools.product(*TUNE_GRID.values()):
        config = dict(zip(TUNE_GRID, values), BLOCK_M=block_m)
        if group % config["BLOCK_K"]:
            continue
        try:
            ms = _time_ms(lambda: w4a16_linear(x, qweight, scales, None, group, **config), iters, device)
        except Exception:  # a tile the GPU cannot hold: not a candidate
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    return best, best_ms


def run(args) -> list[dict]:
    import torch

    from pagedllm.benchmarks.latency import copy_bandwidth_bytes_per_s
    from pagedllm.model import layers
    from pagedllm.model.quantization import fp8
    from pagedllm.model.quantization.int4 import int4_linear, pack_rows

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = SHAPES["tiny-llama" if args.tiny else args.shape]
    bandwidth = copy_bandwidth_bytes_per_s(device, (8 if args.tiny else 1024) << 20)
    group = 128
    rows_out = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, (n, k) in projections(shape).items():
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
        qweight = pack_rows(torch.randint(0, 16, (k, n), generator=g)).to(device)
        scales = (torch.rand(k // group, n, generator=g) * 0.01).to(device, dtype)
        w8, w8_scale = fp8.quantize_weight_per_channel(w)
        block_scale = torch.rand(-(-n // 128), k // 128, generator=g).to(device) * 0.01
        sizes = {"bf16": n * k * w.element_size(), "w4a16": n * k // 2 + scales.numel() * scales.element_size(),
                 "fp8": n * k + n * 4, "fp8_block": n * k + block_scale.numel() * 4}
        for m in args.rows:
            x = torch.randn(m, k, generator=g).to(device, dtype)
            paths = {
                "bf16": lambda: layers.linear(x, w),
                "w4a16": lambda: int4_linear(x, qweight, scales, None, group, None),
                "fp8": lambda: fp8.fp8_linear(x, w8, w8_scale, None, "dynamic"),
                "fp8_block": lambda: fp8.fp8_block_linear(x, w8, block_scale, None, (128, 128)),
            }
            row = {"benchmark": "quant_kernel", "shape": "tiny-llama" if args.tiny else args.shape,
                   "projection": name, "n": n, "k": k, "rows": m, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1)}
            for path, fn in paths.items():
                ms = _time_ms(fn, args.iters, device)
                row[f"{path}_ms"] = round(ms, 4)
                row[f"{path}_roofline"] = round(sizes[path] / bandwidth * 1e3 / ms, 3)
            if args.tune and not args.tiny:
                best, best_ms = _tune_w4a16(x, qweight, scales, group, max(3, args.iters // 4), device)
                row.update(w4a16_tuned=best, w4a16_tuned_ms=round(best_ms, 4))
            emit(row)
            rows_out.append(row)
    return rows_out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--rows", type=int_list, default=[1, 16, 32, 256, 4096], help="comma-separated row counts")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tune", action="store_true", help="time a grid of W4A16 tilings per row count")
    p.add_argument("--tiny", action="store_true", help="a small shape on the CPU (torch paths): a smoke test")
    args = p.parse_args(argv)
    rows = run(args)
    print_table(rows, ["projection", "rows", "bf16_ms", "w4a16_ms", "fp8_ms", "fp8_block_ms", "bf16_roofline",
                       "w4a16_roofline", "fp8_roofline"])


if __name__ == "__main__":
    main()
