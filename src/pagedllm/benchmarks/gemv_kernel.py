"""Half-precision decode projections (issue 19): the small-row Triton kernels' tilings (K split or
not) against cuBLAS, at a shape's projections and decode row counts, as one GPU holds them at
tensor-parallel size --tp (qkv, gate_up and the LM head split on N; o and down on K).

--tune: per (projection, row bucket) every candidate is timed as a decode step runs it: over a
rotation of weight copies (>= 256 MB per replay, so L2 holds none) captured in one CUDA graph.
The fastest Triton candidate within 1% of cuBLAS's output is written to the table
``triton_ops.linear`` dispatches from (``pagedllm/ops/gemv_configs.json``, merged with the entries
already there; --config-out elsewhere) if it is at least --margin faster than cuBLAS, else the
entry says cuBLAS. Without --tune: the dispatch as it stands (table or default rule) against cuBLAS.
"""
from __future__ import annotations

import argparse
import itertools

from pagedllm.benchmarks.common import SHAPES, emit, int_list, print_table
from pagedllm.benchmarks.quant_kernel import _graph_ms, projections

GRID = {"block_n": (32, 64, 128), "block_k": (128, 256, 512), "stages": ((4, 3), (4, 4)), "split_k": (1, 2, 3, 4)}
GEMV_GRID = {"block_n": (4, 8, 16), "stages": ((4, 2), (4, 3))}  # the one-row kernel: K in tiles of up to 512
# Past 32 rows (row tiles of 64 or 128; stop 52): the weight's tile and the rows' share shared memory.
ROW_TILE_GRID = {"block_m": (64, 128), "block_n": (64, 128), "block_k": (64, 128), "stages": ((4, 3), (4, 4), (8, 3)),
                 "split_k": (1, 2, 4)}


def candidates(m: int, k: int) -> list[dict]:
    from pagedllm.ops.triton_gemv import block_k_for

    if m > 32:
        return [dict(kernel="dot", block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=w, num_stages=st)
                for bm, bn, bk, (w, st), split in itertools.product(*ROW_TILE_GRID.values())
                if k % bk == 0 and bm <= max(64, m)]
    dots = [dict(kernel="dot", block_n=bn, block_k=bk, split_k=split, num_warps=w, num_stages=st)
            for bn, bk, (w, st), split in itertools.product(*GRID.values()) if k % bk == 0]
    if m > 1 or block_k_for(k, 512) is None:
        return dots
    return [dict(kernel="gemv", block_n=bn, block_k=block_k_for(k, 512), split_k=1, num_warps=w, num_stages=st)
            for bn, (w, st) in itertools.product(*GEMV_GRID.values())] + dots


def shard_projections(shape: dict, tp: int, names: list[str]) -> dict[str, tuple[int, int]]:
    """(N, K) of each named projection on one GPU at tensor-parallel size ``tp``."""
    full = {**projections(shape), "lm_head": (shape["vocab_size"], shape["hidden_size"])}
    by_n = {"qkv", "gate_up", "lm_head"}  # column-parallel; o and down are row-parallel
    return {name: (full[name][0] // tp, full[name][1]) if name in by_n else (full[name][0], full[name][1] // tp)
            for name in names}


def _weights(n: int, k: int, device: str, dtype):
    import torch

    copies = max(2, min(64, -(-(256 << 20) // (2 * n * k)))) if device == "cuda" else 2  # cpu: smoke runs
    return [torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5 for _ in range(copies)]


def _time(x, weights, fn, replays: int) -> float:
    return _graph_ms(lambda: [fn(x, w) for w in weights], replays) * 1e3 / len(weights)


def tune_projection(name: str, n: int, k: int, rows: list[int], args, table: dict) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pagedllm.ops import triton_gemv

    weights = _weights(n, k, args.device, torch.bfloat16)
    entry = table.setdefault(triton_gemv.config_key(n, k), {})
    out = []
    for m in rows:
        x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16)
        want = F.linear(x, weights[0]).float()
        cublas_us = _time(x, weights, F.linear, args.replays)
        results = []
        for config in candidates(m, k):
            try:
                got = triton_gemv.small_m_linear(x, weights[0], **config).float()
                if ((got - want).norm() / want.norm()).item() > 1e-2:
                    print(f"# {name} m={m} {config}: differs from cuBLAS", flush=True)
                    continue
                results.append((config, _time(x, weights, lambda a, w: triton_gemv.small_m_linear(a, w, **config),
                                              args.replays)))
            except Exception as e:  # noqa: BLE001 - a tiling the GPU cannot hold is no candidate
                print(f"# {name} m={m} {config}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        best, best_us = min(results, key=lambda r: r[1]) if results else (None, float("inf"))
        default = triton_gemv.default_config(m, n, k)
        default_us = next((us for c, us in results if c == default), cublas_us if default is None else None)
        use_triton = best_us <= cublas_us * (1 - args.margin)
        entry[str(m)] = {**best, "us": round(best_us, 2)} if use_triton else {"kernel": "cublas",
                                                                              "us": round(cublas_us, 2)}
        picked_us = best_us if use_triton else cublas_us
        row = {"benchmark": "gemv_tune", "shape": args.shape, "tp": args.tp, "projection": name, "n": n, "k": k,
               "rows": m, "candidates": len(results), "pick": entry[str(m)], "pick_us": round(picked_us, 2),
               "cublas_us": round(cublas_us, 2), "default_us": None if default_us is None else round(default_us, 2),
               "best_unsplit_us": round(min((us for c, us in results if c["split_k"] == 1), default=float("nan")), 2),
               "copy_roofline": round(2 * n * k / args.bandwidth / (picked_us * 1e-6), 3)}
        emit(row)
        out.append(row)
    del weights
    return out


def compare(name: str, n: int, k: int, rows: list[int], args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pagedllm.ops import triton_gemv
    from pagedllm.ops.triton_ops import linear

    weights = _weights(n, k, args.device, torch.bfloat16)
    out = []
    for m in rows:
        x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16)
        dispatch_us, cublas_us = _time(x, weights, linear, args.replays), _time(x, weights, F.linear, args.replays)
        row = {"benchmark": "gemv_dispatch", "shape": args.shape, "tp": args.tp, "projection": name, "n": n, "k": k,
               "rows": m, "config": triton_gemv.decode_config(m, n, k), "dispatch_us": round(dispatch_us, 2),
               "cublas_us": round(cublas_us, 2), "speedup": round(cublas_us / dispatch_us, 3),
               "copy_roofline": round(2 * n * k / args.bandwidth / (dispatch_us * 1e-6), 3)}
        emit(row)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: the shards one GPU holds")
    p.add_argument("--projections", default="qkv,o,gate_up,down,lm_head", help="comma-separated")
    p.add_argument("--rows", type=int_list, default=[1, 8, 16, 32], help="comma-separated row counts (buckets)")
    p.add_argument("--tune", action="store_true", help="sweep the tilings per row bucket; write the table")
    p.add_argument("--margin", type=float, default=0.02, help="--tune: how much faster than cuBLAS to be picked")
    p.add_argument("--config-out", default=None, help="--tune: where to write the table (default: the package's)")
    p.add_argument("--replays", type=int, default=10, help="graph replays timed per measurement (median)")
    args = p.parse_args(argv)
    import torch

    from pagedllm.benchmarks.latency import copy_bandwidth_bytes_per_s
    from pagedllm.ops import triton_gemv
    from pagedllm.ops.tile_tables import note_tuned_on, read_table, write_table

    args.device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton's interpreter (smoke runs)
    args.bandwidth = copy_bandwidth_bytes_per_s(args.device, 1024 << 20 if args.device == "cuda" else 64 << 20)
    projs = shard_projections(SHAPES[args.shape], args.tp, args.projections.split(","))
    rows = []
    if args.tune:
        path = args.config_out or triton_gemv.CONFIG_FILE
        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        table = {"_doc": "bf16/fp16 small-row configs by N,K and row bucket: pagedllm.benchmarks.gemv_kernel "
                         "--tune; {'kernel': 'cublas'}: cuBLAS was faster; shapes it lacks take "
                         "triton_gemv.default_config; _tuned_on: the GPU each run's rows were tuned on",
                 **read_table(path)}
        note_tuned_on(path, table, args.rows, gpu)
        for name, (n, k) in projs.items():
            rows += tune_projection(name, n, k, args.rows, args, table)
            write_table(path, table)  # after each projection: a later crash keeps these
        triton_gemv.reload_config_table()
        print_table(rows, ["projection", "n", "k", "rows", "pick_us", "cublas_us", "default_us", "copy_roofline"])
    else:
        for name, (n, k) in projs.items():
            rows += compare(name, n, k, args.rows, args)
        print_table(rows, ["projection", "n", "k", "rows", "dispatch_us", "cublas_us", "speedup", "copy_roofline"])


if __name__ == "__main__":
    main()
