"""Rotary (+ Qwen3's q/k norm) and the KV write: two launches against the fused one (issue 19).

python scripts/rotary_kv_probe.py

Times each variant per layer call in a CUDA graph of 20 calls (µs per call, median of 5
replays of 50 graphs), for the llama3-8b and qwen3-0.6b head shapes at decode and prefill
token counts; the fused launch at 8, 4 and 2 heads per program.
"""
from __future__ import annotations

import statistics

import torch

from pagedllm.attention.triton_kernels import reshape_and_cache
from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.ops.triton_ops import KVWrite, rotary_embedding

SHAPES = {"llama3-8b": (32, 8, 128, False), "qwen3-0.6b": (16, 8, 128, True)}


def _time(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (50 * calls))
    return statistics.median(times)


def main() -> None:
    dev = torch.device("cuda")
    print("shape       tokens  two launches  fused/8  fused/4  fused/2   (µs per layer call)")
    for name, (hq, hk, hd, norm) in SHAPES.items():
        config = type("C", (), {"rope_theta": 1e6, "rope_scaling": None})()
        rope = RotaryEmbedding(hd, 8192, config).to(dev)
        for tokens in (1, 8, 32, 128, 512):
            qkv = torch.randn(tokens, (hq + 2 * hk) * hd, device=dev, dtype=torch.bfloat16)
            q, k, v = (x.view(tokens, -1, hd) for x in qkv.split([hq * hd, hk * hd, hk * hd], dim=-1))
            positions = torch.randint(0, 8192, (tokens,), device=dev)
            cache = torch.zeros(2, 4096, 16, hk, hd, device=dev, dtype=torch.bfloat16)
            slots = torch.randperm(4096 * 16, device=dev)[:tokens]
            w = (torch.ones(hd, device=dev, dtype=torch.bfloat16), torch.ones(hd, device=dev, dtype=torch.bfloat16),
                 1e-6) if norm else ()

            def two():
                q2, k2 = rotary_embedding(positions, q, k, rope.cos_sin_cache, *w)
                reshape_and_cache(k2, v, cache, slots)

            row = [_time(two)]
            for block_h in (8, 4, 2):
                row.append(_time(lambda: rotary_embedding(positions, q, k, rope.cos_sin_cache, *w,
                                                          kv_write=KVWrite(v, cache, slots), block_h=block_h)))
            print(f"{name:11s} {tokens:6d}  " + "  ".join(f"{t:12.2f}" if i == 0 else f"{t:7.2f}"
                                                      for i, t in enumerate(row)))


if __name__ == "__main__":
    main()
