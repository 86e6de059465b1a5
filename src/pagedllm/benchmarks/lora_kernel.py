"""The multi-LoRA kernels (``ops/triton_lora.py``) on one layer's projections of a shape, timed
in CUDA graphs (no launch gaps) against the projection's own GEMM (the engine's dispatch,
``triton_ops.linear``): per token count, the projection with its adapters as the engine runs it
(up to 32 tokens: the shrink, then the GEMM with the expand in its epilogue, launched while the
shrink runs unless ``PAGEDLLM_LORA_PDL=0``; beyond: the GEMM, then shrink and expand), and the
separate shrink + expand with the default launch config and,
with ``--sweep``, the best of a sweep (K split, block sizes). Tokens spread evenly over
``--num-adapters`` adapters; decode-sized counts are padded to a CUDA graph's fixed grid.

    python -m pagedllm.benchmarks.lora_kernel [--shape llama3-8b] [--rank 16] [--tokens 1,32,256,2048] [--sweep]
"""
from __future__ import annotations

import argparse
import itertools

from pagedllm.benchmarks.common import SHAPES, emit
from pagedllm.benchmarks.quant_kernel import projections as gemm_shapes

SPLITS, BLOCK_KS, BLOCK_NS = (1, 2, 4, 8, 16), (64, 128, 256), (64, 128, 256)


def projections(cfg: dict, rank: int) -> dict[str, tuple[int, int, int]]:
    """name -> (K, N, R): a fused projection's adapters stack one rank per part."""
    parts = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
    return {name: (k, n, parts[name] * rank) for name, (n, k) in gemm_shapes(cfg).items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--tokens", default="1,8,32,64,128,256,2048,8192")
    p.add_argument("--sweep", action="store_true", help="also sweep the separate kernels' launch configs")
    args = p.parse_args(argv)

    import numpy as np
    import torch
    from triton.testing import do_bench_cudagraph

    from pagedllm.ops import triton_lora as tl_lora
    from pagedllm.ops import triton_ops

    cfg, dev, dt = SHAPES[args.shape], "cuda", torch.bfloat16
    layers = cfg["num_hidden_layers"]
    totals: dict[int, list[float]] = {}
    for m in (int(t) for t in args.tokens.split(",")):
        slots = np.arange(m) % args.num_adapters
        ids, tiles = tl_lora.sort_by_slot(slots)
        graph_tiles = tl_lora.max_tiles(m, args.num_adapters) if m <= 256 else len(tiles)
        pad = graph_tiles - len(tiles)
        ids = torch.from_numpy(np.concatenate([ids, np.full(pad * tl_lora.BLOCK_M, -1)])).to(dev)
        tiles = torch.from_numpy(np.concatenate([tiles, np.full(pad, -1)])).to(dev)
        token_slots = torch.from_numpy(slots).to(dev) if m <= 32 else None
        pdl = m <= 32 and tl_lora.pdl_supported(torch.device(dev))
        for name, (k, n, r) in projections(cfg, args.rank).items():
            x = torch.randn(m, k, device=dev, dtype=dt)
            y = torch.zeros(m, n, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
            a = torch.randn(args.num_adapters, r, k, device=dev, dtype=dt) / k ** 0.5
            b = torch.randn(args.num_adapters, n, r, device=dev, dtype=dt) * 0.01
            base_us = 1e3 * do_bench_cudagraph(lambda: triton_ops.linear(x, w), rep=20)
            engine_us = 1e3 * do_bench_cudagraph(lambda: triton_ops.linear(
                x, w, lora=tl_lora.lora_shrink(x, a, b, ids, tiles, token_slots, pdl=pdl)), rep=20)

            def run(config):
                return 1e3 * do_bench_cudagraph(lambda: tl_lora.lora_apply(x, y, a, b, ids, tiles, config), rep=20)

            default = tl_lora.default_config(graph_tiles, -(-r // tl_lora.block_r_for(r)), m, n, k)
            default_us = run(default)
            best_us, best = default_us, default
            if args.sweep:
                for split, bk, bn in itertools.product(SPLITS if m <= 256 else (1,), BLOCK_KS, BLOCK_NS):
                    config = {"split": split, "block_k": bk, "block_n": bn}
                    try:
                        us = run(config)
                    except Exception:  # a tile the GPU cannot hold: not a candidate
                        continue
                    if us < best_us:
                        best_us, best = us, config
            tot = totals.setdefault(m, [0.0, 0.0, 0.0, 0.0])
            for i, v in enumerate((base_us, engine_us, default_us, best_us)):
                tot[i] += v * layers / 1e3
            emit({"benchmark": "lora_kernel", "shape": args.shape, "rank": args.rank, "tokens": m, "proj": name,
                  "base_gemm_us": round(base_us, 2), "with_lora_us": round(engine_us, 2),
                  "separate_default_us": round(default_us, 2), "default": default,
                  "separate_best_us": round(best_us, 2), "best": best})
    for m, (base, engine, default, best) in totals.items():
        emit({"benchmark": "lora_kernel_step", "shape": args.shape, "tokens": m, "base_gemms_ms": round(base, 3),
              "with_lora_ms": round(engine, 3), "overhead": round(engine / base - 1, 3),
              "separate_default_ms": round(default, 3), "separate_best_ms": round(best, 3)})


if __name__ == "__main__":
    main()
