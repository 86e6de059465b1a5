"""The quantized linear kernels alone, at a shape's projections (default llama3-8b: qkv 6144 x 4096,
o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336) and 1, 16, 32, 256 and 4096 rows:
the dense bf16 linear (the engine's: small-row Triton kernels or cuBLAS), W4A16 (Triton, groups of
128, symmetric), FP8 W8A8 per channel (activation quantization + the small-row kernel or
``torch._scaled_mm``) and block-wise FP8 (128 x 128). One JSON line per (projection, rows): the
median time of each (CUDA events), and for each the bytes of weights (and scales) it reads over
that time as a fraction of the measured device copy bandwidth (the decode roofline: at a few rows
a projection can only be as fast as reading its weight).

--tune-tiled times a grid of the tiled W4A16 kernel's tilings (tile sizes, warps, stages, the
packed-load variant) per row count and reports the fastest (``pagedllm.ops.triton_int4.tiles_for``).
--tiny runs a small shape on the CPU (the torch paths only) as a smoke test.

Decode (issue 17), not launch-bound: single kernels of a few microseconds time their launches, so
--tune and --graph-chain capture many launches in one CUDA graph and time its replays.

--tune sweeps the split-K decode kernel (dot or FMA variant, BLOCK_N, warps, stages, SPLIT_K; past
32 rows, row tiles of 32 and 64) at the shape's four projections and each of --rows (row buckets,
up to 512), against the tiled kernel and (from 64 rows) dequantizing the weight, then cuBLAS, and
writes the best per (rows, N, K) as the table ``w4a16_linear`` dispatches from (--config-out,
default ``pagedllm/ops/w4a16_configs.json``). Each candidate is timed over a rotation of weight
copies (>= 256 MB per replay, so L2 holds none of them), one graph replay per rotation.

--graph-chain times one decode step's projections (qkv, o, gate_up, down) x the shape's layers,
one weight set per layer, captured in one CUDA graph, at each of --rows: bf16 ``F.linear``, the
tiled int4 kernel, the split-K kernel with its untuned default and with the table. One JSON line
per (path, rows): ms per step and the fraction of the roofline of the bytes a step reads (packed
weights + scales (+ zeros); bf16 weights) at --peak-gb-s (H100 HBM3 3,350) and at the measured
copy bandwidth.
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


def _graph_ms(launch, replays: int = 10) -> float:
    """Median ms of one replay of a CUDA graph holding ``launch()`` (run once eagerly first: compiles,
    the split-K counters)."""
    import statistics
    import time

    import torch

    launch()
    if not torch.cuda.is_available():  # the CPU smoke test (Triton's interpreter): one eager run
        t0 = time.perf_counter()
        launch()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(2):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def _int4_weight(n: int, k: int, group: int, zero_points: bool, device: str):
    import torch

    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32, device=device)  # random nibbles
    scales = (torch.rand(k // group, n, device=device) * 0.01 + 0.001).to(torch.float16)  # as GPTQ writes them
    qzeros = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // group, n // 8), dtype=torch.int32, device=device) \
        if zero_points else None
    return qweight, scales, qzeros


def _int4_bytes(n: int, k: int, group: int, zero_points: bool) -> int:
    return n * k // 2 + (k // group) * n * 2 + ((k // group) * n // 2 if zero_points else 0)


SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DOT_TILES = [dict(BLOCK_N=bn, num_warps=w, num_stages=st) for bn in (64, 128, 256)
             for w, st in ((4, 3), (4, 4), (8, 3))] + \
    [dict(BLOCK_N=512, num_warps=w, num_stages=3) for w in (8, 16)]  # (16 rows only: 32 spill at 8 warps)
FMA_TILES = [dict(BLOCK_N=bn, num_warps=w, num_stages=2) for bn in (128, 256) for w in (4, 8)]
# About 70 compiled variants in all (each tile with and without the split, the transposed kernel too): a few
# minutes of compiling.


def splitk_candidates(m: int, n: int, k: int, group: int, sm_count: int) -> list[dict]:
    """The sweep's split-K configs at ``m`` rows: the dot variant (group 128; up to 256 columns also
    transposed, ``SWAP``) and, up to 4 rows, the FMA one, each tile with every split that keeps the
    grid under 8 programs per SM and the fp32 partials under a quarter of the packed weight's bytes."""
    import triton

    from pagedllm.ops.triton_int4 import splitk_eligible

    out = []
    dot_rows = (16,) if m <= 16 else (32,) if m <= 32 else (32, 64)  # wider batches: row tiles
    variants = [(True, block_m, DOT_TILES) for block_m in dot_rows] if group >= 128 else []
    if m <= 4:
        variants.append((False, 1 << (m - 1).bit_length(), FMA_TILES))
    for use_dot, block_m, tiles in variants:
        block_k = 128 if use_dot else min(group, 128)
        k_tiles = k // block_k
        for tile in tiles:
            if tile["BLOCK_N"] * block_m > 512 * 16:
                continue
            n_tiles = triton.cdiv(n, tile["BLOCK_N"])
            seen = set()
            for split in SPLITS:
                split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, min(split, k_tiles)))
                if split in seen or (split > 1 and (n_tiles * split > 8 * sm_count or 8 * split * m * n > n * k // 8)):
                    continue
                seen.add(split)
                config = dict(BLOCK_M=block_m, BLOCK_K=block_k, USE_DOT=use_dot, SPLIT_K=split, **tile)
                # each dot tile also transposed (triton_int4_swap: the weights as wgmma's 64-row operand)
                swap = use_dot and tile["BLOCK_N"] <= 256
                for cand in (config, dict(config, SWAP=True)) if swap else (config,):
                    if splitk_eligible(m, group, cand):
                        out.append(cand)
    return out


def _checked_best(results: list, x, weight: tuple, group: int, what: str) -> tuple:
    """The fastest of ``results`` ((kind, config, ms)) that computes what the tiled kernel computes
    (fresh inputs in ``x``; ``weight`` (qweight, scales, qzeros)): (kind, config, ms)."""
    from pagedllm.ops import triton_int4

    qw, sc, zr = weight
    x.normal_()
    want = triton_int4.w4a16_linear(x, qw, sc, zr, group, decode=False).float()
    for cand_kind, cand, cand_ms in sorted(results, key=lambda r: r[2]):
        if cand_kind == "tiled":
            return cand_kind, cand, cand_ms
        decode = triton_int4.DEQUANT if cand_kind == "dequant" else cand
        got = triton_int4.w4a16_linear(x, qw, sc, zr, group, decode=decode).float()
        err = ((got - want).norm() / want.norm()).item()
        if err < 1e-2:
            return cand_kind, cand, cand_ms
        print(f"# {what} {cand}: relative difference {err:.3g} from the tiled kernel: skipped", flush=True)
    return "tiled", None, float("inf")


def tune_splitk(args) -> dict:
    """The --tune sweep: JSON lines per (rows, projection), and the table it writes."""
    import torch

    from pagedllm.ops import triton_int4
    from pagedllm.ops.tile_tables import note_tuned_on, read_table, write_table

    shape = SHAPES[args.shape]
    group, device = 128, "cuda" if torch.cuda.is_available() else "cpu"
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    path = args.config_out or triton_int4.CONFIG_FILE
    # A run replaces its row buckets and keeps the file's others (_tuned_on: which GPU tuned which rows).
    table: dict = {"_doc": "W4A16 split-K decode configs by N,K,G and row bucket ({'kernel': 'tiled' | 'dequant'} "
                           "where that path won): pagedllm.benchmarks.quant_kernel --tune; shapes it "
                           "lacks take triton_int4.default_splitk_config; _tuned_on: the GPU each run's rows were "
                           "tuned on", **read_table(path)}
    note_tuned_on(path, table, [m for m in args.rows if m <= triton_int4.M_BUCKETS[-1]], gpu)
    for name, (n, k) in projections(shape).items():
        nbytes = _int4_bytes(n, k, group, args.zero_points)
        copies = max(2, -(-(256 << 20) // nbytes)) if device == "cuda" else 1
        weights = [_int4_weight(n, k, group, args.zero_points, device) for _ in range(copies)]
        entry = table.setdefault(triton_int4.config_key(n, k, group), {})
        for m in args.rows:
            if m > triton_int4.M_BUCKETS[-1]:
                continue
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)

            def chain(**kw):
                return lambda: [triton_int4.w4a16_linear(x, qw, s, z, group, **kw) for qw, s, z in weights]

            results = []
            try:
                results.append(("tiled", None, _graph_ms(chain(decode=False), args.replays) / copies))
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"# tiled {name} m={m}: {type(e).__name__}: {e}", flush=True)
            if m >= 64:  # dequantize, then cuBLAS (the path of DEQUANT_ROWS and more)
                results.append(("dequant", None, _graph_ms(chain(decode=triton_int4.DEQUANT), args.replays) / copies))
            default = triton_int4.default_splitk_config(m, n, k, group, sm_count)
            default_ms = None
            candidates = [default] + splitk_candidates(m, n, k, group, sm_count)
            for config in candidates if device == "cuda" else candidates[:3]:
                try:
                    ms = _graph_ms(chain(decode=config), args.replays) / copies
                except Exception as e:  # noqa: BLE001 - a tile the GPU cannot hold is no candidate
                    print(f"# {config}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                default_ms = ms if default_ms is None and config is default else default_ms
                results.append(("splitk", config, ms))
            kind, best, best_ms = _checked_best(results, x, weights[0], group, f"{name} m={m}")
            tiled_ms = next((r[2] for r in results if r[0] == "tiled"), None)
            # the fastest without the transposed kernel (not checked against the tiled kernel: a note)
            unswapped = min((r for r in results if not (r[1] or {}).get("SWAP")), key=lambda r: r[2],
                            default=(None, None, float("nan")))
            entry[str(m)] = {"kernel": kind, "ms": round(best_ms, 5)} if kind in ("tiled", "dequant") else \
                {**best, "ms": round(best_ms, 5)}
            emit({"benchmark": "w4a16_tune", "shape": args.shape, "projection": name, "n": n, "k": k, "rows": m,
                  "candidates": len(results), "best_kernel": kind, "best": best, "best_us": round(best_ms * 1e3, 2),
                  "default_us": None if default_ms is None else round(default_ms * 1e3, 2),
                  "tiled_us": None if tiled_ms is None else round(tiled_ms * 1e3, 2),
                  "dequant_us": next((round(r[2] * 1e3, 2) for r in results if r[0] == "dequant"), None),
                  "best_unswapped_us": round(unswapped[2] * 1e3, 2), "best_unswapped": unswapped[1],
                  "best_roofline": round(nbytes / (args.peak_gb_s * 1e9) / (best_ms * 1e-3), 3)})
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()
        # After each projection: a later crash keeps these.
        write_table(path, table)
    triton_int4.reload_config_table()
    return table


def graph_chain(args) -> list[dict]:
    """The --graph-chain benchmark (see the module's docstring)."""
    import torch
    import torch.nn.functional as F

    from pagedllm.benchmarks.latency import copy_bandwidth_bytes_per_s
    from pagedllm.model.quantization.int4 import dequantize
    from pagedllm.ops import triton_int4

    shape = SHAPES[args.shape]
    layers = args.layers or shape["num_hidden_layers"]
    group, device = 128, "cuda" if torch.cuda.is_available() else "cpu"
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
    bandwidth = copy_bandwidth_bytes_per_s(device, (1024 if device == "cuda" else 8) << 20)
    projs = projections(shape)
    int4 = [{name: _int4_weight(n, k, group, args.zero_points, device) for name, (n, k) in projs.items()}
            for _ in range(layers)]
    int4_bytes = layers * sum(_int4_bytes(n, k, group, args.zero_points) for n, k in projs.values())
    bf16_bytes = layers * sum(n * k * 2 for n, k in projs.values())
    rows_out = []
    for m in args.rows:
        xs = {k: torch.randn(m, k, device=device, dtype=torch.bfloat16) for k in {k for _, k in projs.values()}}
        # The split-K kernel (table dispatch) against the tiled one and the dequantized reference, once.
        qw, s, z = int4[0]["o"]
        n, k = projs["o"]
        ref = xs[k].double() @ dequantize(qw, s, z, group, k, torch.bfloat16).double()
        rel = {path: ((y.double() - ref).norm() / ref.norm()).item() for path, y in (
            ("splitk", triton_int4.w4a16_linear(xs[k], qw, s, z, group)),
            ("tiled", triton_int4.w4a16_linear(xs[k], qw, s, z, group, decode=False)))}

        def int4_step(decode):
            def launch():
                for layer in int4:
                    for name, (n, k) in projs.items():
                        qw, s, z = layer[name]
                        cfg = decode(n, k) if callable(decode) else decode
                        triton_int4.w4a16_linear(xs[k], qw, s, z, group, decode=cfg)
            return launch

        paths = {"w4a16_tiled": (int4_step(False), int4_bytes),
                 "w4a16_splitk_default": (int4_step(lambda n, k: triton_int4.default_splitk_config(
                     m, n, k, group, sm_count)), int4_bytes),
                 "w4a16_splitk": (int4_step(None), int4_bytes)}
        for path, (launch, nbytes) in paths.items():
            try:
                ms = _graph_ms(launch, args.replays)
            except Exception as e:  # noqa: BLE001 - report, go on with the other paths
                print(f"# {path} rows={m}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            row = {"benchmark": "w4a16_graph_chain", "shape": args.shape, "layers": layers, "rows": m, "path": path,
                   "ms_per_step": round(ms, 4), "weight_gb": round(nbytes / 1e9, 3),
                   "roofline": round(nbytes / (args.peak_gb_s * 1e9) / (ms * 1e-3), 3),
                   "copy_roofline": round(nbytes / bandwidth / (ms * 1e-3), 3),
                   "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "zero_points": args.zero_points}
            if path in ("w4a16_splitk", "w4a16_tiled"):
                row["rel_err_o_proj"] = round(rel[path[6:]], 5)
            emit(row)
            rows_out.append(row)
    del int4
    torch.cuda.empty_cache()
    # bf16 last (14 GB of weights for llama3-8b): F.linear, one weight per layer and projection.
    bf16 = [{name: torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for name, (n, k) in projs.items()}
            for _ in range(layers)]
    for m in args.rows:
        xs = {k: torch.randn(m, k, device=device, dtype=torch.bfloat16) for k in {k for _, k in projs.values()}}

        def launch():
            for layer in bf16:
                for name, (n, k) in projs.items():
                    F.linear(xs[k], layer[name])

        ms = _graph_ms(launch, args.replays)
        row = {"benchmark": "w4a16_graph_chain", "shape": args.shape, "layers": layers, "rows": m, "path": "bf16",
               "ms_per_step": round(ms, 4), "weight_gb": round(bf16_bytes / 1e9, 3),
               "roofline": round(bf16_bytes / (args.peak_gb_s * 1e9) / (ms * 1e-3), 3),
               "copy_roofline": round(bf16_bytes / bandwidth / (ms * 1e-3), 3),
               "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1)}
        emit(row)
        rows_out.append(row)
    return rows_out


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
            if args.tune_tiled and not args.tiny:
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
    p.add_argument("--tune", action="store_true",
                   help="sweep the split-K decode kernel per row bucket and projection; write the table")
    p.add_argument("--tune-tiled", action="store_true", help="time a grid of the tiled W4A16 kernel's tilings")
    p.add_argument("--graph-chain", action="store_true",
                   help="a decode step's projections x layers in one CUDA graph: bf16, tiled and split-K int4")
    p.add_argument("--config-out", default=None, help="--tune: where to write the table (default: the package's)")
    p.add_argument("--replays", type=int, default=10, help="graph replays timed per measurement (median)")
    p.add_argument("--layers", type=int, default=None, help="--graph-chain: layers (default: the shape's)")
    p.add_argument("--zero-points", action="store_true", help="int4 weights with zero points (default: symmetric, "
                   "as the latency benchmark's GPTQ)")
    p.add_argument("--peak-gb-s", type=float, default=3350.0, help="the roofline's memory bandwidth (H100 HBM3)")
    p.add_argument("--tiny", action="store_true", help="a small shape on the CPU (torch paths): a smoke test")
    args = p.parse_args(argv)
    if args.tune or args.graph_chain:
        from pagedllm.model.quantization.int4 import CHAIN_PDL_MAX_ROWS
        from pagedllm.ops.triton_pdl import set_chain_max_rows

        set_chain_max_rows(CHAIN_PDL_MAX_ROWS)  # the kernels launched as a W4A16 model's forwards launch them
        rows = []
        if args.tune:
            tune_splitk(args)
        if args.graph_chain:
            rows = graph_chain(args)
            print_table(rows, ["path", "rows", "ms_per_step", "roofline", "copy_roofline", "weight_gb"])
        return
    rows = run(args)
    print_table(rows, ["projection", "rows", "bf16_ms", "w4a16_ms", "fp8_ms", "fp8_block_ms", "bf16_roofline",
                       "w4a16_roofline", "fp8_roofline"])


if __name__ == "__main__":
    main()
