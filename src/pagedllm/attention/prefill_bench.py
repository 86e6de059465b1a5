"""Long-prompt prefill attention on a GPU: the Triton paged kernel against torch's SDPA backends.

``python -m pagedllm.attention.prefill_bench [--sweep]`` on the device machine. Each case is a
batch of prompts (no cached prefix) or one chunk after a cached prefix; the causal attention's
FLOPs (4 * head_dim * heads * (q * context + q * (q + 1) / 2) per sequence) over the time gives
TFLOP/s. The Triton path is timed as the model runner runs it (KV write + attention from the
paged cache, in a CUDA graph); torch's SDPA backends (cuDNN, flash, memory-efficient) run on
contiguous q/k/v of one sequence at a time (``enable_gqa``), as a prefill-only fast path could.
Rows: ``gluon`` (the warp-specialized Gluon kernel, attention/gluon_prefill.py, what a causal long run takes by
default on Hopper), ``prefill`` (the Triton prefill kernel, attention/triton_prefill.py, as
``PAGEDLLM_GLUON_PREFILL=0`` and other GPUs run it), ``unified`` (the unified kernel's long tiles, as
``PAGEDLLM_PREFILL_KERNEL=0`` runs them).
``--sweep`` also times other tilings of both prefill kernels. One JSON line per result, a table last.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedllm.attention import triton_prefill as tp
from pagedllm.attention.kernel_bench import SHAPES, make_case, rel_error, time_graphs

CASES = [("llama3-8b", [(0, 512)] * 8), ("llama3-8b", [(0, 1024)] * 4), ("llama3-8b", [(0, 2048)]), ("llama3-8b", [(0, 4096)]), ("llama3-8b", [(0, 8192)]),
         ("llama3-8b", [(0, 16384)]), ("llama3-8b", [(0, 4096)] * 4), ("llama3-8b", [(6144, 2048)]),
         ("qwen3-0.6b", [(0, 4096)] * 4), ("qwen3-0.6b", [(0, 8192)])]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def causal_flops(runs, heads: int, head_dim: int) -> float:
    return sum(4 * head_dim * heads * (q * c + q * (q + 1) / 2) for c, q in runs)


def time_fn(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times[1:])


def sdpa_case(heads, kv_heads, head_dim, runs, dtype):
    """Per sequence [1, heads, len, hd] tensors: the prefix's K/V and the chunk's, contiguous."""
    seqs = []
    for c, q in runs:
        seqs.append((torch.randn(1, heads, q, head_dim, dtype=dtype, device="cuda"),
                     torch.randn(1, kv_heads, c + q, head_dim, dtype=dtype, device="cuda"),
                     torch.randn(1, kv_heads, c + q, head_dim, dtype=dtype, device="cuda")))
    return seqs


def sdpa_run(seqs, runs):
    for (q, k, v), (c, _) in zip(seqs, runs):
        if c == 0:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # a chunk after a cached prefix: causal aligned to the bottom right
            from torch.nn.attention.bias import causal_lower_right
            F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                           enable_gqa=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time other tilings of the prefill kernel")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    print(f"device {torch.cuda.get_device_name()}", flush=True)
    # (name, Triton prefill tiles, prefill kernel, the Gluon kernel where it applies: False or its CONFIG changes)
    variants = [("gluon", None, True, {}), ("prefill", None, True, False), ("unified", None, False, False)]
    if args.sweep:
        variants += [(f"prefill m{m} n{n} w{w} s{s}", dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s), True,
                      False) for m, n, w, s in ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 8, 3))]
        variants += [(f"gluon {' '.join(f'{k}={v}' for k, v in over.items())}", None, True, over)
                     for over in (dict(STAGES=3), dict(STAGES=2), dict(PWARPS=1), dict(PWARPS=4))]
    rows = []
    default_prefill_tiles, default_gluon = tp.prefill_tile_config, tp._gluon_prefill
    gp = tp._gluon_prefill()
    gluon_config = gp.CONFIG if gp is not None else None
    for shape, runs in CASES:
        heads, kvh, hd = SHAPES[shape]
        flops = causal_flops(runs, heads, hd)
        name = f"{shape} {len(runs)}x(ctx {runs[0][0]}, q {runs[0][1]})"
        case = make_case(heads, kvh, hd, runs, dtype, gen)
        for variant, tiles, prefill, gluon in variants:
            if gluon is False:  # as PAGEDLLM_GLUON_PREFILL=0 runs
                tp._gluon_prefill = lambda: None
            elif gp is not None:
                gp.CONFIG = {**gluon_config, **gluon}
            if tiles is not None:
                tp.prefill_tile_config = lambda head_dim, ieee, tiles=tiles: tiles
            try:
                t = time_graphs([case], 5, prefill_kernel=prefill)
                err = rel_error(case) if runs[0][1] <= 8192 else float("nan")
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile or fit: report, go on
                rows.append(dict(case=name, path=variant, error=repr(e)[:160]))
                print(json.dumps(rows[-1]), flush=True)
                continue
            finally:
                tp.prefill_tile_config, tp._gluon_prefill = default_prefill_tiles, default_gluon
                if gp is not None:
                    gp.CONFIG = gluon_config
            rows.append(dict(case=name, path=variant, ms=round(t * 1e3, 3), tflops=round(flops / t / 1e12, 1),
                             rel_err=float(f"{err:.2e}")))
            print(json.dumps(rows[-1]), flush=True)
        del case
        seqs = sdpa_case(heads, kvh, hd, runs, dtype)
        for backend, kind in BACKENDS.items():
            try:
                with sdpa_kernel(kind):
                    t = time_fn(lambda: sdpa_run(seqs, runs))
            except Exception as e:  # noqa: BLE001 - a backend that refuses the case: report, go on
                rows.append(dict(case=name, path=f"sdpa {backend}", error=repr(e).splitlines()[0][:160]))
                print(json.dumps(rows[-1]), flush=True)
                continue
            rows.append(dict(case=name, path=f"sdpa {backend}", ms=round(t * 1e3, 3),
                             tflops=round(flops / t / 1e12, 1)))
            print(json.dumps(rows[-1]), flush=True)
        del seqs
        torch.cuda.empty_cache()
    print(f"\n{'case':36s} {'path':26s} {'ms':>9s} {'TFLOP/s':>8s}")
    for r in rows:
        tail = r["error"] if "error" in r else f"{r['ms']:9.3f} {r['tflops']:8.1f}"
        print(f"{r['case']:36s} {r['path']:26s} {tail}")


if __name__ == "__main__":
    main()
