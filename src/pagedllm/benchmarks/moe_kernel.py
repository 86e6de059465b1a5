"""The fused-MoE kernel alone: the Triton kernel (CUDA) against the torch reference path and a naive
loop of one ``torch.bmm`` per expert, at 1, 32, 256 and 4096 tokens of a shape's MoE layer
(default qwen3-30b-a3b: 128 experts top-8, hidden 2048, moe_intermediate 768). Random bf16
inputs, softmax top-k routing of random router logits. One JSON line per token count: the median
time of each path over --iters calls (CUDA events on a GPU), and the Triton result's largest
difference from the reference.

--tune times a grid of tile configs per token count (in a CUDA graph up to 256 tokens, as
decode steps run), times the fastest again beside the tile the bucket takes now, and writes it into
the kernel's table (ops/fused_moe_configs.json, or --config-out) only if it is faster by
``TUNE_MARGIN`` (else the bucket keeps its tile: a pick within noise is no pick), keyed by (experts,
hidden, intermediate per rank, batch bucket); --tp sizes the intermediate per rank as tensor
parallelism slices it.
--weight-format fp8 | fp8-block | int4: quantized experts (random fp8 weights with per-channel
scales or 128 x 128 block scales; random int4 words, groups of 128 with float16 scales and zero
points; smaller groups where the shape's sizes are not multiples of 128), timed and tuned under their own key of the table (``,W=<format>``; an untuned format
takes the 16-bit experts' tiles). Their reference is the torch path over the same quantized
weights; the bmm loop (16-bit weights only) is left out.
--tiny runs a small shape on the CPU (the torch paths only) as a smoke test.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time

from pagedllm.benchmarks.common import SHAPES, emit, int_list, print_table

TUNE_GRID = {"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (32, 64, 128), "BLOCK_K": (64, 128), "num_warps": (4, 8),
             "num_stages": (3, 4)}


GRAPH_TOKENS = 256  # up to here decode steps replay CUDA graphs: tiles are timed in one (beyond, CUDA events)
TUNE_MARGIN = 0.02  # a tuned tile replaces the bucket's tile only when this much faster


def keeps_pick(before_ms: float, picked_ms: float) -> bool:
    """Whether --tune writes its pick: faster than the bucket's current tile by ``TUNE_MARGIN``."""
    return picked_ms < before_ms * (1 - TUNE_MARGIN)


def _time_ms(fn, iters: int, device: str, graph: bool = False) -> float:
    """Median ms of ``fn``; ``graph``: replayed in a CUDA graph, as decode steps run it (no host
    launch time in the figure, which at a few tokens would otherwise be most of it)."""
    import torch

    fn()  # warm-up (and compile)
    if graph and device.startswith("cuda"):
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=max(10, iters))
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _inputs(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int, dtype, device: str,
            fmt: str = "native"):
    """(x, w13, w2, weights, ids) and the experts' scales (None for 16/32-bit weights)."""
    import torch

    from pagedllm.ops.fused_moe import route

    g = torch.Generator(device="cpu").manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
    weights, ids = route(torch.randn(num_tokens, num_experts, generator=g).to(device), top_k, renormalize=True)
    if fmt != "native":
        w13, w2, scales = _quantized_experts(num_experts, hidden, inter, fmt, device, g)
        return (x, w13, w2, weights, ids), scales
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(device, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5).to(device, dtype)
    return (x, w13, w2, weights, ids), None


def _quantized_experts(num_experts: int, hidden: int, inter: int, fmt: str, device: str, g):
    """Random experts held as ``fmt`` (what the kernels read; the values only need to be finite)."""
    import torch

    from pagedllm.ops.moe_scales import ExpertScales

    def fp8(n: int, k: int, block):
        w = torch.randn(num_experts, n, k, generator=g).clamp(-4, 4).to(torch.float8_e4m3fn).to(device)
        shape = (num_experts, n) if block is None else (num_experts, -(-n // block[0]), -(-k // block[1]))
        return w, torch.full(shape, 0.02 / k ** 0.5, device=device)

    group = math.gcd(128, hidden, inter)  # 128 on real shapes; smaller on the tiny CPU one

    def int4(n: int, k: int):
        words = torch.randint(-2 ** 31, 2 ** 31 - 1, (num_experts, k // 8, n), generator=g, dtype=torch.int32)
        scale = torch.full((num_experts, n, k // group), 0.2 / k ** 0.5, dtype=torch.float16)
        zeros = torch.randint(0, 16, (num_experts, n, k // group), generator=g, dtype=torch.uint8)
        return words.to(device), scale.to(device), zeros.to(device)

    if fmt == "int4":
        (w13, s13, z13), (w2, s2, z2) = int4(2 * inter, hidden), int4(hidden, inter)
        return w13, w2, ExpertScales(s13, s2, group=group, w13_zeros=z13, w2_zeros=z2)
    block = (128, 128) if fmt == "fp8-block" else None
    (w13, s13), (w2, s2) = fp8(2 * inter, hidden, block), fp8(hidden, inter, block)
    return w13, w2, ExpertScales(s13, s2, block=block)


def tune_grid(num_tokens: int, top_k: int, num_experts: int, fmt: str) -> list[dict]:
    """The tilings --tune times: row tiles up to 4x an expert's expected run (taller ones only pad),
    and for per-channel fp8 also 256-deep K tiles (its bytes per K tile are half bf16's; block
    scales and int4 groups cut K tiles to 128 anyway)."""
    per_expert = num_tokens * top_k / num_experts
    grid = {**TUNE_GRID, "BLOCK_M": tuple(m for m in TUNE_GRID["BLOCK_M"] if m <= max(16, 4 * per_expert))}
    if fmt == "fp8":
        grid["BLOCK_K"] = (*TUNE_GRID["BLOCK_K"], 256)
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def _tune(args_t, scales, iters: int, device: str, fmt: str) -> tuple[dict, float]:
    from pagedllm.ops.triton_fused_moe import fused_experts_triton

    x, w13 = args_t[0], args_t[1]
    best, best_ms = None, float("inf")
    for config in tune_grid(x.shape[0], args_t[4].shape[1], w13.shape[0], fmt):
        try:
            ms = _time_ms(lambda: fused_experts_triton(*args_t, config=config, scales=scales), iters, device,
                          graph=args_t[0].shape[0] <= GRAPH_TOKENS)
        except Exception:  # a tile the GPU cannot hold (shared memory): not a candidate
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    return best, best_ms


def _write_table(path: str, key: str, tuned: dict[int, dict]) -> None:
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    entry = table.setdefault(key, {})
    entry.update({str(bucket): config for bucket, config in sorted(tuned.items())})
    with open(path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")


def run(args) -> list[dict]:
    import torch

    from pagedllm.ops import fused_moe

    shape = SHAPES[args.shape]
    num_experts, hidden, top_k = shape["num_experts"], shape["hidden_size"], shape["num_experts_per_tok"]
    inter = shape["moe_intermediate_size"] // args.tp
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    use_triton = device.startswith("cuda")
    if use_triton:
        from pagedllm.ops import triton_fused_moe

    fmt = "" if args.weight_format == "native" else args.weight_format
    key = triton_fused_moe.config_key(num_experts, hidden, inter, fmt) if use_triton else None
    rows, tuned = [], {}
    for num_tokens in args.tokens:
        inputs, scales = _inputs(num_experts, hidden, inter, top_k, num_tokens, dtype, device, args.weight_format)
        row = {"benchmark": "moe_kernel", "shape": args.shape, "num_experts": num_experts, "hidden": hidden,
               "inter_per_rank": inter, "top_k": top_k, "num_tokens": num_tokens, "dtype": str(dtype)[6:],
               "weight_format": args.weight_format}
        reference = lambda: fused_moe.fused_experts_torch(*inputs, scales=scales)  # noqa: E731
        if not args.tune:  # the reference paths (slow): not while tuning
            row["torch_ms"] = round(_time_ms(reference, args.iters, device), 4)
            if scales is None:
                row["bmm_loop_ms"] = round(_time_ms(lambda: fused_moe.fused_experts_bmm_loop(*inputs), args.iters,
                                                    device), 4)
        if use_triton:
            config = None
            if args.tune:
                default = triton_fused_moe.get_config(num_experts, hidden, inter, num_tokens, top_k, fmt)
                picked, _ = _tune(inputs, scales, max(3, args.iters // 4), device, fmt)

                def timed(c: dict) -> float:  # the pick and the bucket's tile, timed alike
                    return _time_ms(lambda: triton_fused_moe.fused_experts_triton(*inputs, config=c, scales=scales),
                                    args.iters, device, graph=num_tokens <= GRAPH_TOKENS)

                row["before_ms"] = round(before_ms := timed(default), 4)
                if picked is not None and keeps_pick(before_ms, timed(picked)):
                    config = picked
                    tuned[triton_fused_moe.batch_bucket(num_tokens)] = config
                    _write_table(args.config_out or triton_fused_moe.CONFIG_FILE, key, tuned)  # kept if a later one fails
                else:
                    row["kept_bucket_tile"] = True
            config = config or triton_fused_moe.get_config(num_experts, hidden, inter, num_tokens, top_k, fmt)
            run_triton = lambda: triton_fused_moe.fused_experts_triton(*inputs, config=config,  # noqa: E731
                                                                       scales=scales)
            triton_ms = _time_ms(run_triton, args.iters, device)
            row.update(triton_ms=round(triton_ms, 4), config=config)
            if num_tokens <= GRAPH_TOKENS:
                row["triton_graph_ms"] = round(_time_ms(run_triton, args.iters, device, graph=True), 4)
            for name in ("torch", "bmm_loop"):
                if f"{name}_ms" in row:
                    row[f"speedup_vs_{name}"] = round(row[f"{name}_ms"] / triton_ms, 2)
            row["max_abs_diff"] = float((run_triton().float() - reference().float()).abs().max())
        emit(row)
        rows.append(row)
    if tuned:
        path = args.config_out or triton_fused_moe.CONFIG_FILE
        _write_table(path, key, tuned)
        print(f"wrote {len(tuned)} tuned config(s) to {path}")
    return rows


def main(argv: list[str] | None = None) -> None:
    from pagedllm.ops.moe_scales import WEIGHT_FORMATS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    moe_shapes = sorted(name for name, cfg in SHAPES.items() if "num_experts" in cfg)
    p.add_argument("--shape", choices=moe_shapes, default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int_list, help="token counts (default 1,32,256,4096; with --tiny 1,32,256)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks slicing the intermediate size")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: bfloat16 on CUDA")
    p.add_argument("--device", help="default: cuda when available, else cpu (torch paths only)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tune", action="store_true", help="search tile configs and write the fastest to the table")
    p.add_argument("--config-out", help="the table to write with --tune (default: the kernel's own)")
    p.add_argument("--weight-format", choices=["native", *filter(None, WEIGHT_FORMATS)], default="native",
                   help="the experts' weights: in --dtype (native), or quantized")
    p.add_argument("--tiny", action="store_true", help="the tiny-qwen3-moe shape, few iterations (a CPU smoke run)")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.iters = "tiny-qwen3-moe", min(args.iters, 3)
    args.tokens = args.tokens or ([1, 32, 256] if args.tiny else [1, 32, 256, 4096])
    rows = run(args)
    print_table(rows, ["num_tokens", "triton_ms", "torch_ms", "bmm_loop_ms", "speedup_vs_torch", "max_abs_diff"])


if __name__ == "__main__":
    main()
