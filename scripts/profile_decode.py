"""Where a decode step's time goes on a GPU: kernels per step with their mean duration, the
sum of kernel time per step against the wall time per step (the rest is launch gaps and
host work). Graph replays are traced too (CUPTI records the kernels of a replayed graph).

python scripts/profile_decode.py [--shape llama3-8b] [--batch 1] [--engine-args enforce_eager=true]
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.benchmarks.common import parse_engine_args, write_shape


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--engine-args", default="")
    p.add_argument("--top", type=int, default=24)
    args = p.parse_args()
    extra = parse_engine_args(args.engine_args) if args.engine_args else {}
    llm = LLM(write_shape(args.shape), load_format="dummy", skip_tokenizer_init=True, **extra)
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randint(0, 10000) for _ in range(args.input_len)])
               for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    first = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1, detokenize=False)
    t0 = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    step_ms = (time.perf_counter() - t0 - ttft) / (args.output_len - 1) * 1e3
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    steps = args.output_len - 1
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            by_name[e.name].append(e.time_range.end - e.time_range.start)
    total = sum(sum(v) for v in by_name.values()) / 1e3
    n_kernels = sum(len(v) for v in by_name.values())
    print(f"{args.shape} batch {args.batch} {args.engine_args or 'default'}: {step_ms:.3f} ms/step unprofiled; "
          f"kernels {total / (steps + 1):.3f} ms/step of kernel time, {n_kernels / (steps + 1):.0f} kernels/step")
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]
    print(f"{'ms/step':>8} {'per step':>8} {'mean us':>8}  kernel")
    for name, durs in rows:
        print(f"{sum(durs) / 1e3 / (steps + 1):8.3f} {len(durs) / (steps + 1):8.1f} {sum(durs) / len(durs):8.2f}  {name[:100]}")


if __name__ == "__main__":
    main()
