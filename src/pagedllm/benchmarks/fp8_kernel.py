"""FP8 W8A8 decode projections (issue 17): the Triton small-row kernel's tilings (K split or not)
against ``torch._scaled_mm``, at a shape's four projections (default llama3-8b) and decode row
counts.

--tune: per (projection, row bucket) every candidate is timed as the engine would run it: the
per-token quantize launch plus the small-row kernel, or the quantize launch plus
``torch._scaled_mm``; over a rotation of weight
copies (>= 256 MB per replay, so L2 holds none of them) captured in one CUDA graph (no launch
gaps in the figure; the engine replays decode steps in graphs). The fastest candidate whose
output is within 1% of ``_scaled_mm``'s is written to the table ``triton_fp8`` dispatches from
(--config-out, default ``pagedllm/ops/fp8_configs.json``).

--graph-chain: one decode step's projections x the shape's layers (one weight set per layer) in
one CUDA graph, per row count: the table's dispatch, the untuned default (the small-row kernel to
16 rows, then ``_scaled_mm``), ``_scaled_mm`` throughout, and the quantize launches alone. One
JSON line per (path, rows) with ms per step and the fraction of the roofline of the fp8 weights
(+ their scales) at the measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import itertools

from pagedllm.benchmarks.common import SHAPES, emit, int_list, print_table
from pagedllm.benchmarks.quant_kernel import _graph_ms, projections

# The first sweep (stop 33, H100) also had 16-wide tiles, 128-wide K steps and the activations
# quantized inside the kernel (each program taking its rows' absmax first): none won anywhere.
GRID = {"BLOCK_N": (32, 64, 128), "BLOCK_K": (256, 512, 1024), "stages": ((4, 3), (4, 4), (8, 4)),
        "SPLIT_K": (1, 2, 4, 8)}
# Past 32 rows (row tiles of 64 or 128; stop 52): the weight tile and the rows' tile share shared memory.
ROW_TILE_GRID = {"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "BLOCK_K": (128, 256),
                 "stages": ((4, 3), (4, 4), (8, 3), (8, 4)), "SPLIT_K": (1, 2, 4)}


def candidates(rows: int = 1) -> list[dict]:
    if rows <= 32:
        return [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=w, num_stages=st)
                for bn, bk, (w, st), split in itertools.product(*GRID.values())]
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=w, num_stages=st)
            for bm, bn, bk, (w, st), split in itertools.product(*ROW_TILE_GRID.values()) if bm <= max(64, rows)]


def _weights(n: int, k: int, copies: int, device: str):
    import torch

    from pagedllm.model.quantization.fp8 import FP8_DTYPE

    return [((torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(FP8_DTYPE),
             torch.rand(n, device=device) * 1e-3 + 1e-4) for _ in range(copies)]


def tune(args) -> dict:
    import torch

    from pagedllm.model.quantization.fp8 import fp8_linear
    from pagedllm.ops import triton_fp8
    from pagedllm.ops.tile_tables import note_tuned_on, read_table, write_table

    gpu = torch.cuda.get_device_name(0)
    # The rows tuned now replace their buckets' entries; the other buckets' stay.
    path = args.config_out or triton_fp8.CONFIG_FILE
    table: dict = read_table(path)
    table["_doc"] = (f"FP8 W8A8 small-row configs by N,K and row bucket: pagedllm.benchmarks.fp8_kernel --tune "
                     f"({args.shape}); {{'kernel': 'scaled_mm'}}: torch._scaled_mm was faster; shapes it lacks take "
                     f"triton_fp8.default_config up to 16 rows; _tuned_on: the GPU each run's rows were tuned on")
    note_tuned_on(path, table, args.rows, gpu)
    for name, (n, k) in projections(SHAPES[args.shape]).items():
        copies = max(2, -(-(256 << 20) // (n * k)))
        weights = _weights(n, k, copies, "cuda")
        entry = table.setdefault(triton_fp8.config_key(n, k), {})
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def chain(decode):
                return lambda: [fp8_linear(x, w, s, None, "dynamic", decode=decode) for w, s in weights]

            want = fp8_linear(x, *weights[0], None, "dynamic", decode=False).float()
            results = [("scaled_mm", None, _graph_ms(chain(False), args.replays) / copies)]
            for config in candidates(m):
                try:
                    got = fp8_linear(x, *weights[0], None, "dynamic", decode=config).float()
                    err = ((got - want).norm() / want.norm()).item()
                    if err > 1e-2:
                        print(f"# {name} m={m} {config}: relative difference {err:.3g} from _scaled_mm", flush=True)
                        continue
                    results.append(("small_m", config, _graph_ms(chain(config), args.replays) / copies))
                except Exception as e:  # noqa: BLE001 - a tile the GPU cannot hold is no candidate
                    print(f"# {name} m={m} {config}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            kind, best, best_ms = min(results, key=lambda r: r[2])
            default = triton_fp8.default_config(n)
            default_ms = next((r[2] for r in results if r[1] == default), None)
            entry[str(m)] = {"kernel": "scaled_mm", "ms": round(best_ms, 5)} if kind == "scaled_mm" else \
                {**best, "ms": round(best_ms, 5)}
            emit({"benchmark": "fp8_tune", "shape": args.shape, "projection": name, "n": n, "k": k, "rows": m,
                  "candidates": len(results), "best_kernel": kind, "best": best, "best_us": round(best_ms * 1e3, 2),
                  "scaled_mm_us": round(results[0][2] * 1e3, 2),
                  "default_us": None if default_ms is None else round(default_ms * 1e3, 2),
                  "best_unsplit_us": round(min((r[2] for r in results if r[1] and r[1]["SPLIT_K"] == 1),
                                               default=float("nan")) * 1e3, 2),
                  "best_copy_roofline": round((n * k + 4 * n) / args.bandwidth / (best_ms * 1e-3), 3)})
        del weights
        torch.cuda.empty_cache()
        # After each projection: a later crash keeps these.
        write_table(args.config_out or triton_fp8.CONFIG_FILE, table)
    triton_fp8.reload_config_table()
    return table


def graph_chain(args) -> list[dict]:
    import torch

    from pagedllm.model.quantization.fp8 import fp8_linear
    from pagedllm.ops import triton_fp8

    shape = SHAPES[args.shape]
    layers = args.layers or shape["num_hidden_layers"]
    projs = projections(shape)
    weights = [{name: _weights(n, k, 1, "cuda")[0] for name, (n, k) in projs.items()} for _ in range(layers)]
    nbytes = layers * sum(n * k + 4 * n for n, k in projs.values())
    rows_out = []
    for m in args.rows:
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k in {k for _, k in projs.values()}}

        def step(decode):
            def launch():
                for layer in weights:
                    for name, (n, k) in projs.items():
                        d = decode(n) if callable(decode) else decode
                        fp8_linear(xs[k], *layer[name], None, "dynamic", decode=d)
            return launch

        def quant_only():
            for _ in weights:
                for _, k in projs.values():
                    triton_fp8.quantize_fp8(xs[k])

        paths = {"table": step(None),
                 "default": step(lambda n: triton_fp8.default_config(n) if m <= 16 else False),
                 "scaled_mm": step(False), "quantize_only": quant_only}
        for path, launch in paths.items():
            ms = _graph_ms(launch, args.replays)
            row = {"benchmark": "fp8_graph_chain", "shape": args.shape, "layers": layers, "rows": m, "path": path,
                   "ms_per_step": round(ms, 4), "weight_gb": round(nbytes / 1e9, 3),
                   "copy_roofline": round(nbytes / args.bandwidth / (ms * 1e-3), 3),
                   "copy_bandwidth_gb_s": round(args.bandwidth / 1e9, 1)}
            emit(row)
            rows_out.append(row)
    return rows_out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--rows", type=int_list, default=[1, 2, 4, 8, 16, 32], help="comma-separated row counts")
    p.add_argument("--tune", action="store_true", help="sweep the small-row kernel per row bucket; write the table")
    p.add_argument("--graph-chain", action="store_true", help="a decode step's projections x layers in one graph")
    p.add_argument("--config-out", default=None, help="--tune: where to write the table (default: the package's)")
    p.add_argument("--replays", type=int, default=10, help="graph replays timed per measurement (median)")
    p.add_argument("--layers", type=int, default=None, help="--graph-chain: layers (default: the shape's)")
    args = p.parse_args(argv)
    import torch

    from pagedllm.benchmarks.latency import copy_bandwidth_bytes_per_s

    if not torch.cuda.is_available():
        raise SystemExit("fp8_kernel: needs a CUDA GPU with fp8 tensor cores")
    args.bandwidth = copy_bandwidth_bytes_per_s("cuda", 1024 << 20)
    if args.tune:
        tune(args)
    if args.graph_chain:
        rows = graph_chain(args)
        print_table(rows, ["path", "rows", "ms_per_step", "copy_roofline", "weight_gb"])


if __name__ == "__main__":
    main()
