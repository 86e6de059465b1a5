"""Where a speculative step's time goes on a GPU: a draft model (both dummy), every draft
accepted (PAGEDLLM_SPEC_FORCE_ACCEPT=1), one request; torch.profiler's top ops by host
and by device time, and cProfile's top Python functions of the same steps.

    PAGEDLLM_SPEC_FORCE_ACCEPT=1 python scripts/spec_profile.py [--shape llama3-8b] [--draft-shape llama3.2-1b] [--k 3]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.benchmarks.common import SHAPES, write_shape

p = argparse.ArgumentParser()
p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
p.add_argument("--draft-shape", choices=sorted(SHAPES), default="llama3.2-1b")
p.add_argument("--k", type=int, default=3)
p.add_argument("--tokens", type=int, default=64)
args = p.parse_args()
llm = LLM(write_shape(args.shape), load_format="dummy", skip_tokenizer_init=True, max_model_len=2048,
          kv_cache_memory_bytes=4 << 30,
          speculative_config={"model": write_shape(args.draft_shape), "num_speculative_tokens": args.k})
prompt = [TokensPrompt(prompt_token_ids=list(range(100, 228)))]
params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.tokens, detokenize=False)
for _ in range(2):
    llm.generate(prompt, params, use_tqdm=False)
torch.cuda.synchronize()
t = time.perf_counter()
llm.generate(prompt, params, use_tqdm=False)
torch.cuda.synchronize()
dt = time.perf_counter() - t
stats = llm.llm_engine.engine_core.scheduler.make_stats()
print(f"{args.tokens} tokens in {dt * 1e3:.1f} ms: {dt * 1e3 / args.tokens:.2f} ms/token, "
      f"drafts {stats.spec_num_drafts}, accepted {stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens}")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    llm.generate(prompt, params, use_tqdm=False)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
pr = cProfile.Profile()
pr.enable()
llm.generate(prompt, params, use_tqdm=False)
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(35)
