"""Where LoRA's overhead goes on a GPU: a reduced workload 1 (and batch-1 decode) without and
with adapters, each under torch.profiler; wall time, device kernel time, and the kernels whose
total time grew the most.

    python scripts/lora_profile.py [--shape llama3-8b] [--num-prompts 64] [--max-len 512]
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.benchmarks.common import write_shape
from pagedllm.benchmarks.lora import push_random_adapters

p = argparse.ArgumentParser()
p.add_argument("--shape", default="llama3-8b")
p.add_argument("--num-prompts", type=int, default=64)
p.add_argument("--max-len", type=int, default=512)
p.add_argument("--num-adapters", type=int, default=4)
p.add_argument("--rank", type=int, default=16)
args = p.parse_args()
llm = LLM(write_shape(args.shape), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
          enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
adapters = push_random_adapters(llm, args.num_adapters, args.rank)
random.seed(0)
prompts = [TokensPrompt(prompt_token_ids=[random.randint(0, 10000) for _ in range(random.randint(100, args.max_len))])
           for _ in range(args.num_prompts)]
params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, args.max_len),
                         detokenize=False) for _ in prompts]
spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
one = [TokensPrompt(prompt_token_ids=list(range(100, 228)))]
greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64, detokenize=False)
runs = {"w1_base": (prompts, params, None), "w1_lora": (prompts, params, spread),
        "b1_base": (one, greedy, None), "b1_lora": (one, greedy, adapters[0])}
for ps, sp, lr in runs.values():  # warm-up: every graph and kernel variant compiled
    llm.generate(ps[:8], sp[:8] if isinstance(sp, list) else sp, use_tqdm=False,
                 lora_request=lr[:8] if isinstance(lr, list) else lr)
kernels: dict[str, dict[str, float]] = {}
for name, (ps, sp, lr) in runs.items():
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(ps, sp, use_tqdm=False, lora_request=lr)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(ps, sp, use_tqdm=False, lora_request=lr)
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.key_averages():
        per[ev.key[:70]] += ev.self_device_time_total / 1e3  # ms
    kernels[name] = per
    print(f"{name}: wall {wall * 1e3:9.1f} ms  device kernels {sum(per.values()):9.1f} ms")
for pair in (("w1_base", "w1_lora"), ("b1_base", "b1_lora")):
    base, lora = kernels[pair[0]], kernels[pair[1]]
    grown = sorted(((lora.get(k, 0) - base.get(k, 0), k) for k in set(base) | set(lora)), reverse=True)[:8]
    print(f"{pair[1]} against {pair[0]}: kernels that grew (ms)")
    for d, k in grown:
        print(f"  {d:+9.2f}  {base.get(k, 0):9.2f} -> {lora.get(k, 0):9.2f}  {k}")
