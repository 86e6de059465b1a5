"""Times the Triton attention kernels on a GPU against the memory roofline, with tile sweeps.

``python -m pagedllm.attention.kernel_bench [--quick]`` on the device machine. Decode cases
time the per-layer KV write + attention captured in a CUDA graph (as the model runner replays
it), rotating over several caches so repeated replays do not measure L2; the floor is the K/V
bytes read at the measured device-to-device copy bandwidth. Prefill cases report TFLOP/s of
the causal attention. Every variant is also checked against a float32 SDPA over the gathered
K/V (relative error). The table is printed last. ``--kv-cache-dtype fp8`` (or fp8_e5m2) runs
the same cases over an fp8 cache (scales 4/448; the floor counts 1 byte per K/V element, the
error is against the dequantized cache). ``--split-sweep`` times split-KV decodes instead: batches
of 1-64 sequences over 128-16k keys at forced split counts beside the default's choice (whether the
launch merged its splits itself, ``triton_kernels._self_merges``, or in a second launch), each
checked against the float32 reference. ``--fp8-map`` times the default decode launch over a bf16 and an
fp8 cache side by side by batch and context (one shape's heads): where the fp8 cache gains and where not.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from pagedllm.attention import triton_kernels as tk
from pagedllm.attention.kv_quant import FP8_KV_DTYPES, dequantize, quantize

# heads, kv heads, head_dim
SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama3-8b": (32, 8, 128), "qwen3-30b-a3b": (32, 4, 128)}
SPLIT_SWEEP = dict(shapes=("qwen3-30b-a3b", "llama3-8b"), batches=(1, 2, 4, 8, 16, 32, 64),
                   contexts=(128, 256, 1024, 4096, 16384), splits=(None, 1, 2, 4, 8, 16))  # None: the default's choice
BLOCK_SIZE = 16


def copy_bandwidth_gbs() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * x.numel() / statistics.median(times[2:]) / 1e9


def make_case(heads, kv_heads, head_dim, runs, dtype, gen, dev="cuda", kv_dtype=None):
    """Random paged batch: runs are (cached context, query length); scattered block tables;
    ``kv_dtype`` an fp8 dtype for an fp8 cache (None: the model dtype)."""
    seq_lens = [c + q for c, q in runs]
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, generator=gen, device="cpu")
    table = torch.zeros(len(runs), max(blocks), dtype=torch.int32)
    i = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = perm[i:i + nb]
        i += nb
    slots = []
    for r, (c, q) in enumerate(runs):
        pos = torch.arange(c, c + q)
        slots.append(table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    num_tokens = sum(q for _, q in runs)
    qsl = torch.tensor([0] + [q for _, q in runs]).cumsum(0).to(torch.int32)
    return dict(
        q=torch.randn(num_tokens, heads, head_dim, dtype=dtype, device=dev),
        k=torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=dev),
        v=torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=dev),
        cache=torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=dev),
        slots=torch.cat(slots).to(dev), block_tables=table.to(dev), qsl=qsl.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        out=torch.empty(num_tokens, heads, head_dim, dtype=dtype, device=dev),
        max_query_len=max(q for _, q in runs), runs=runs, kv_scale=None,
    ) if kv_dtype is None else _fp8_case(make_case(heads, kv_heads, head_dim, runs, dtype, gen, dev), kv_dtype)


def _fp8_case(case, kv_dtype):
    scale = torch.tensor([4 / 448, 4 / 448], device=case["cache"].device)
    case["cache"] = torch.stack([quantize(case["cache"][i], scale[i], kv_dtype) for i in (0, 1)])
    case["kv_scale"] = scale
    return case


def run(case, **kw):
    tk.reshape_and_cache(case["k"], case["v"], case["cache"], case["slots"], case["kv_scale"])
    tk.unified_attention(case["q"], case["cache"], case["block_tables"], case["qsl"], case["seq_lens"],
                         case["q"].shape[-1] ** -0.5, case["out"], max_query_len=case["max_query_len"],
                         kv_scale=case["kv_scale"], **kw)


def rel_error(case) -> float:
    """Float32 SDPA per sequence over K/V gathered from the cache (after the run wrote them)."""
    q_all, cache, scale = case["q"].float(), case["cache"], case["q"].shape[-1] ** -0.5
    if case["kv_scale"] is None:
        cache = cache.float()
    else:
        cache = torch.stack([dequantize(cache[i], case["kv_scale"][i], torch.float32) for i in (0, 1)])
    group = q_all.shape[1] // cache.shape[3]
    errs, refs = 0.0, 0.0
    start = 0
    for r, (c, ql) in enumerate(case["runs"]):
        nb = -(-(c + ql) // BLOCK_SIZE)
        ids = case["block_tables"][r, :nb].long()
        k = cache[0, ids].flatten(0, 1)[:c + ql].repeat_interleave(group, 1).transpose(0, 1)
        v = cache[1, ids].flatten(0, 1)[:c + ql].repeat_interleave(group, 1).transpose(0, 1)
        q = q_all[start:start + ql].transpose(0, 1)
        pos = torch.arange(c + ql, device=q.device)
        mask = pos[None, :] <= pos[c:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
        got = case["out"][start:start + ql].float()
        errs += (got - ref).pow(2).sum().item()
        refs += ref.pow(2).sum().item()
        start += ql
    return (errs / refs) ** 0.5


def time_graphs(cases, iters: int, **kw) -> float:
    """Median seconds per replay, rotating over one captured graph per case."""
    graphs = []
    for case in cases:
        run(case, **kw)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run(case, **kw)
        graphs.append(g)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            graphs[i % len(graphs)].replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times[1:])


def with_tiles(block_n=None, num_stages=None, num_warps=None):
    """Override the short (decode) tile config while timing a variant."""
    original = tk._tile_config

    def patched(long_queries, *args):
        cfg = original(long_queries, *args)
        if not long_queries:
            cfg = dict(cfg, **{k: v for k, v in (("BLOCK_N", block_n), ("num_stages", num_stages),
                                                  ("num_warps", num_warps)) if v})
        return cfg

    return original, patched


def split_sweep(gen, dtype, dev="cuda", kv_dtype=None) -> None:
    """Decode launches at forced split counts (``num_kv_splits``) and the default's, µs per layer
    (KV write + attention in a CUDA graph), by batch and context; one JSON line each, a table last.
    ``kv_dtype``: an fp8 cache (its own default bound, ``_default_num_splits(fp8=True)``)."""
    num_sms = tk._num_sms(torch.device(dev))
    table = []
    for shape in SPLIT_SWEEP["shapes"]:
        heads, kvh, hd = SHAPES[shape]
        for batch in SPLIT_SWEEP["batches"]:
            for ctx in SPLIT_SWEEP["contexts"]:
                case = make_case(heads, kvh, hd, [(ctx - 1, 1)] * batch, dtype, gen, dev=dev, kv_dtype=kv_dtype)
                case["max_query_len"] = 1
                default = tk._default_num_splits(True, batch * kvh, case["q"].device, kv_dtype is not None)
                cells = []
                for splits in SPLIT_SWEEP["splits"]:
                    if splits is not None and splits > 1 and batch * kvh * splits > 8 * num_sms:
                        continue
                    t = time_graphs([case], 50, num_kv_splits=splits)
                    n = default if splits is None else splits
                    merge = "none" if n == 1 else "own" if tk._self_merges(batch * kvh) else "kernel"
                    row = dict(case=f"decode {shape} b{batch} ctx{ctx}", splits=splits or f"default ({default})",
                               merge=merge, us=round(t * 1e6, 1), rel_err=float(f"{rel_error(case):.2e}"))
                    print(json.dumps(row), flush=True)
                    cells.append(f"{'d' if splits is None else splits}:{row['us']:.1f}")
                table.append(f"{shape:14s} b{batch:<3d} ctx {ctx:6d} | " + " ".join(cells))
                del case
    print(f"\nµs per layer by split count (d: the default; launches of {tk.SELF_MERGE_MIN_ROWS} program rows "
          "and more merge their splits themselves and split each row by its context: at most that many parts)")
    print("\n".join(table))


def decode_cases(shape: str, batch: int, ctx: int, dtype, gen, kv_dtype=None, dev="cuda") -> tuple[list, int]:
    """``batch`` decodes over ``ctx`` keys each, as several caches (rotated past L2 when timed), and the
    K/V bytes one of them holds."""
    heads, kvh, hd = SHAPES[shape]
    kv_bytes = batch * ctx * kvh * hd * 2 * (1 if kv_dtype is not None else 2)
    n_sets = max(1, min(8, (256 << 20) // kv_bytes))
    return [make_case(heads, kvh, hd, [(ctx - 1, 1)] * batch, dtype, gen, dev=dev, kv_dtype=kv_dtype)
            for _ in range(n_sets)], kv_bytes


FP8_MAP = {"batches": (4, 8, 16, 32, 64, 128, 256), "contexts": (256, 1024, 2048)}


def fp8_map(gen, dtype, shape: str = "qwen3-0.6b", dev="cuda") -> None:
    """The default decode launch (KV write + attention in a CUDA graph, caches rotated past L2) over a
    bf16 cache and an fp8 (e4m3) one, µs per layer and their ratio, by batch and context."""
    kvh = SHAPES[shape][1]
    fp8 = FP8_KV_DTYPES["fp8_e4m3"]
    lines = []
    for batch in FP8_MAP["batches"]:
        for ctx in FP8_MAP["contexts"]:
            us, splits = [], []
            for kv_dtype in (None, fp8):
                cases, _ = decode_cases(shape, batch, ctx, dtype, gen, kv_dtype, dev)
                us.append(time_graphs(cases, 100) * 1e6)
                splits.append(tk._default_num_splits(True, batch * kvh, cases[0]["q"].device, kv_dtype is not None))
                del cases
            row = dict(case=f"decode {shape} b{batch} ctx{ctx}", bf16_us=round(us[0], 1), fp8_us=round(us[1], 1),
                       bf16_splits=splits[0], fp8_splits=splits[1], fp8_over_bf16=round(us[1] / us[0], 2))
            print(json.dumps(row), flush=True)
            lines.append(f"{shape} b{batch:<3d} ctx {ctx:5d} | bf16 {us[0]:7.1f} ({splits[0]}) | fp8 {us[1]:7.1f} "
                         f"({splits[1]}) | {us[1] / us[0]:.2f}")
    print("\nµs per layer, bf16 cache against fp8 (default splits in brackets), fp8 / bf16 last")
    print("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases and no tile sweep")
    ap.add_argument("--split-sweep", action="store_true", help="split-KV decodes at forced split counts instead")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--fp8-map", action="store_true", help="the default decode launch, bf16 cache against fp8")
    args = ap.parse_args(argv)
    kv_dtype = FP8_KV_DTYPES[{"fp8": "fp8_e4m3"}.get(args.kv_cache_dtype, args.kv_cache_dtype)] \
        if args.kv_cache_dtype != "auto" else None
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    bw = copy_bandwidth_gbs()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s  KV cache {args.kv_cache_dtype}",
          flush=True)
    if args.split_sweep:
        return split_sweep(gen, dtype, kv_dtype=kv_dtype)
    if args.fp8_map:
        return fp8_map(gen, dtype)
    rows = []
    decode = [("llama3-8b", 1, 512), ("llama3-8b", 1, 4096), ("llama3-8b", 32, 384), ("qwen3-0.6b", 256, 1024),
              ("qwen3-0.6b", 64, 2048), ("llama3-8b", 256, 1024)]
    if args.quick:
        decode = decode[:1] + decode[2:4]
    variants = [("default", None, None, None, {})]
    if not args.quick:
        key_tiles = (16, 32, 64) + ((128,) if kv_dtype is not None else ())  # fp8: the same bytes need 2x the keys
        variants += [(f"n{n}/s{s}/w{w}", n, s, w, {}) for w in (4, 8) for n in key_tiles for s in (2, 3, 4)
                     if w == 4 or n >= 32]
        variants += [(f"splits={k}", None, None, None, {"num_kv_splits": k}) for k in (1, 2, 4, 16)]
    for shape, batch, ctx in decode:
        cases, kv_bytes = decode_cases(shape, batch, ctx, dtype, gen, kv_dtype)
        for name, block_n, stages, warps, kw in variants:
            original, patched = with_tiles(block_n, stages, warps)
            tk._tile_config = patched
            try:
                t = time_graphs(cases, 200, **kw)
                err = rel_error(cases[0])
            except Exception as e:  # a variant that does not compile or fit: report, go on
                rows.append(dict(case=f"decode {shape} b{batch} ctx{ctx}", variant=name, error=repr(e)[:120]))
                continue
            finally:
                tk._tile_config = original
            rows.append(dict(case=f"decode {shape} b{batch} ctx{ctx}", variant=name, us=round(t * 1e6, 1),
                             gbs=round(kv_bytes / t / 1e9), roofline=round(kv_bytes / t / 1e9 / bw, 3),
                             rel_err=float(f"{err:.2e}")))
            print(json.dumps(rows[-1]), flush=True)
    prefill = [("llama3-8b", [(0, 2048)]), ("llama3-8b", [(0, 1024)] * 8),
               ("llama3-8b", [(3000, 1024)] + [(800, 1)] * 64)]  # a chunk with a cached prefix, beside decodes
    for shape, runs in prefill[:1] if args.quick else prefill:
        heads, kvh, hd = SHAPES[shape]
        case = make_case(heads, kvh, hd, runs, dtype, gen, kv_dtype=kv_dtype)
        flops = sum(4 * hd * heads * (q * c + q * (q + 1) / 2) for c, q in runs)
        t = time_graphs([case], 20)
        rows.append(dict(case=f"prefill {shape} {len(runs)} seqs {runs[0]}", variant="default", us=round(t * 1e6, 1),
                         tflops=round(flops / t / 1e12, 1), rel_err=float(f"{rel_error(case):.2e}")))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'case':40s} {'variant':10s} {'us':>9s} {'GB/s':>6s} {'roof':>6s} {'TFLOP/s':>8s} {'rel err':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:40s} {r['variant']:10s} {r['error']}")
            continue
        print(f"{r['case']:40s} {r['variant']:10s} {r['us']:9.1f} {r.get('gbs', ''):>6} {r.get('roofline', ''):>6} "
              f"{r.get('tflops', ''):>8} {r['rel_err']:9.2e}")


if __name__ == "__main__":
    main()
