"""Where an embedding call's time goes (issue 22's GPU target): the host's Python (cProfile) and
the device's kernels (torch profiler), for the bert-base shape of `bench embed`."""
from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time

import torch

from pagedllm import LLM
from pagedllm.benchmarks.embed import build, inputs

shape = sys.argv[1] if len(sys.argv) > 1 else "bert-base"
texts = inputs(256, 32, 512)
with tempfile.TemporaryDirectory() as tmp:
    llm = LLM(build(shape, tmp), dtype="bfloat16", max_model_len=512, max_num_seqs=256, max_num_batched_tokens=16384)
    llm.embed(texts[:8], use_tqdm=False)
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.embed(texts, use_tqdm=False)
        torch.cuda.synchronize()
        print(f"embed 256: {(time.perf_counter() - t) * 1e3:.1f} ms")
    prof = cProfile.Profile()
    prof.enable()
    llm.embed(texts, use_tqdm=False)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        llm.embed(texts, use_tqdm=False)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
