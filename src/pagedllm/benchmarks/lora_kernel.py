"""The multi-LoRA kernels (``ops/triton_lora.py``) on one layer's projections of a shape, timed
in CUDA graphs (no launch gaps) against the projection's own GEMM: the default launch config
against the best of a sweep (K split, block sizes), per token count. Tokens spread evenly over
``--num-adapters`` adapters; decode-sized counts are padded to a CUDA graph's fixed grid.

    python -m pagedllm.benchmarks.lora_kernel [--shape llama3-8b] [--rank 16] [--tokens 1,32,256,2048]
"""
from __future__ import annotations

import argparse
import itertools

from pagedllm.benchmarks.common import SHAPES, emit

SPLITS, BLOCK_KS, BLOCK_NS = (1, 2, 4, 8, 16), (64, 128, 256), (64, 128, 256)


def projections(cfg: dict, rank: int) -> dict[str, tuple[int, int, int]]:
    """name -> (K, N, R): a fused projection's adapters stack one rank per part."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim
    return {"qkv": (h, qkv, 3 * rank), "o": (cfg["num_attention_heads"] * head_dim, h, rank),
            "gate_up": (h, 2 * inter, 2 * rank), "down": (inter, h, rank)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--tokens", default="1,8,32,64,128,256,2048,8192")
    p.add_argument("--no-sweep", action="store_true", help="time the default config only")
    args = p.parse_args(argv)

    import numpy as np
    import torch
    from triton.testing import do_bench_cudagraph

    from pagedllm.ops import triton_lora as tl_lora

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
        for name, (k, n, r) in projections(cfg, args.rank).items():
            x = torch.randn(m, k, device=dev, dtype=dt)
            y = torch.zeros(m, n, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
            a = torch.randn(args.num_adapters, r, k, device=dev, dtype=dt) / k ** 0.5
            b = torch.randn(args.num_adapters, n, r, device=dev, dtype=dt) * 0.01
            base_us = 1e3 * do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w), rep=20)

            def run(config):
                return 1e3 * do_bench_cudagraph(lambda: tl_lora.lora_apply(x, y, a, b, ids, tiles, config), rep=20)

            block_r = max(16, min(64, 1 << (r - 1).bit_length()))
            default = tl_lora.default_config(graph_tiles, -(-r // block_r), m, n, k)
            default_us = run(default)
            best_us, best = default_us, default
            if not args.no_sweep:
                for split, bk, bn in itertools.product(SPLITS if m <= 256 else (1,), BLOCK_KS, BLOCK_NS):
                    config = {"split": split, "block_k": bk, "block_n": bn}
                    try:
                        us = run(config)
                    except Exception:  # a tile the GPU cannot hold: not a candidate
                        continue
                    if us < best_us:
                        best_us, best = us, config
            tot = totals.setdefault(m, [0.0, 0.0, 0.0])
            for i, v in enumerate((base_us, default_us, best_us)):
                tot[i] += v * layers / 1e3
            emit({"benchmark": "lora_kernel", "shape": args.shape, "rank": args.rank, "tokens": m, "proj": name,
                  "base_gemm_us": round(base_us, 2), "default_us": round(default_us, 2), "default": default,
                  "best_us": round(best_us, 2), "best": best})
    for m, (base, default, best) in totals.items():
        emit({"benchmark": "lora_kernel_step", "shape": args.shape, "tokens": m, "base_gemms_ms": round(base, 3),
              "lora_default_ms": round(default, 3), "lora_best_ms": round(best, 3),
              "overhead_default": round(default / base, 3), "overhead_best": round(best / base, 3)})


if __name__ == "__main__":
    main()
