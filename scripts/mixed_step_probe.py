"""What a step that carries a prefill chunk loses by running eagerly: one model forward over a
mixed batch (D decodes of context C plus one fresh prompt chunk of P tokens), timed eagerly in a
loop (wall per forward, and the host's launch time per forward without waiting), against the same
forward captured whole in one CUDA graph for that exact metadata (an upper bound on what graphs
of such steps can save; piecewise graphs keep attention outside).

python scripts/mixed_step_probe.py [--shape qwen3-0.6b] [--mixes 64x512+256,0x0+2048]
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedllm import LLM
from pagedllm.attention.backend import AttentionMetadata
from pagedllm.benchmarks.common import write_shape


def mixed_metadata(runner, decodes: int, ctx: int, prefill: int, dev) -> tuple:
    bs = runner.block_size
    lens_q = [1] * decodes + ([prefill] if prefill else [])
    lens_seq = [ctx] * decodes + ([prefill] if prefill else [])
    qsl = [0]
    for n in lens_q:
        qsl.append(qsl[-1] + n)
    blocks_each = -(-max(lens_seq) // bs)
    tables = torch.arange(blocks_each * len(lens_q), dtype=torch.int32, device=dev).view(len(lens_q), -1)
    slots, positions = [], []
    for i, (q, s) in enumerate(zip(lens_q, lens_seq)):
        pos = torch.arange(s - q, s, device=dev)
        positions.append(pos)
        slots.append(pos + i * blocks_each * bs)
    n = qsl[-1]
    md = AttentionMetadata(
        num_actual_tokens=n, slot_mapping=torch.cat(slots), block_tables=tables,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens_seq, dtype=torch.int32, device=dev),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens_seq, max_query_len=max(lens_q), max_seq_len=max(lens_seq))
    ids = torch.randint(0, 1000, (n,), device=dev)
    return ids, torch.cat(positions), md, blocks_each * len(lens_q)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--mixes", default="32x512+64,64x512+256,128x512+512,128x1024+1024,0x0+2048")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--cprofile", action="store_true", help="the host's top functions over the first mix's forwards")
    args = p.parse_args()
    llm = LLM(write_shape(args.shape), load_format="dummy", skip_tokenizer_init=True,
              gpu_memory_utilization=args.gpu_memory_utilization)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    dev, model = runner.device, runner.model
    print(f"# {torch.cuda.get_device_name()}, shape {args.shape}")
    pieces = runner.graphs.piecewise
    print(f"{'mix':>16} {'tokens':>6} {'eager ms':>9} {'host ms':>8} {'graph ms':>9} {'saved':>6} {'pieces ms':>9}")
    for mix in args.mixes.split(","):
        dec, rest = mix.split("x")
        ctx, pre = rest.split("+")
        ids, pos, md, nblocks = mixed_metadata(runner, int(dec), int(ctx), int(pre), dev)
        with torch.inference_mode(), runner.scratch_kv_cache(nblocks):
            for _ in range(3):
                model(ids, pos, md)
            torch.cuda.synchronize()
            host = 0.0
            t0 = time.perf_counter()
            for _ in range(args.iters):
                h0 = time.perf_counter()
                model(ids, pos, md)
                host += time.perf_counter() - h0
            torch.cuda.synchronize()
            eager = (time.perf_counter() - t0) / args.iters * 1e3
            if args.cprofile and mix == args.mixes.split(",")[0]:
                import cProfile
                import pstats
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(5):
                    model(ids, pos, md)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
                pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
            stream = torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                graph.capture_begin()
                model(ids, pos, md)
                graph.capture_end()
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                graph.replay()
            torch.cuda.synchronize()
            graphed = (time.perf_counter() - t0) / args.iters * 1e3
            del graph
            size = pieces.size_for(md.num_actual_tokens) if pieces is not None else None
            piecewise = float("nan")
            if size is not None:  # the piecewise graphs over the same metadata (their inputs: whatever is uploaded)
                pieces.replay(size, md.num_actual_tokens, md)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    pieces.replay(size, md.num_actual_tokens, md)
                torch.cuda.synchronize()
                piecewise = (time.perf_counter() - t0) / args.iters * 1e3
        print(f"{mix:>16} {md.num_actual_tokens:6d} {eager:9.3f} {host / args.iters * 1e3:8.3f} {graphed:9.3f} "
              f"{1 - graphed / eager:6.1%} {piecewise:9.3f}")


if __name__ == "__main__":
    main()
