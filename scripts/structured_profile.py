"""Profile the constrained side of the structured benchmark (cProfile, top functions by cumulative time).

    python scripts/structured_profile.py [--shape qwen3-0.6b] [--num-prompts 128] [--tokenizer DIR]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from pagedllm import LLM, SamplingParams, StructuredOutputsParams, TokensPrompt
from pagedllm.benchmarks.common import write_shape
from pagedllm.benchmarks.structured import SCHEMA, VOCAB_SIZE, _tokenizer_dir

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen3-0.6b")
p.add_argument("--num-prompts", type=int, default=128)
p.add_argument("--tokenizer", default=None)
p.add_argument("--dtype", default="auto")
args = p.parse_args()
llm = LLM(write_shape(args.shape, tokenizer_dir=_tokenizer_dir(args.tokenizer), vocab_size=VOCAB_SIZE),
          load_format="dummy", dtype=args.dtype, max_model_len=4096)
random.seed(0)
prompts = [TokensPrompt(prompt_token_ids=[random.randint(0, 10000) for _ in range(random.randint(100, 1024))])
           for _ in range(args.num_prompts)]
so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=512, structured_outputs=so)
llm.generate(prompts[:2], params, use_tqdm=False)  # compiles the schema
for name, sp in (("free", SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=128)), ("json", params)):
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{name}: {n} tokens in {time.perf_counter() - t:.2f} s")
prof = cProfile.Profile()
prof.enable()
t = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
prof.disable()
print(f"profiled json run: {time.perf_counter() - t:.2f} s")
pstats.Stats(prof).sort_stats("cumulative").print_stats(28)
pstats.Stats(prof).sort_stats("tottime").print_stats(15)
