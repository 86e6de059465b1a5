"""Decode-step profile: 32 requests x 96 tokens; per-step wall time and a torch.profiler table of steps 40-71.
Usage: PYTHONPATH=src python scripts/cpu_profile_decode.py [float32|bfloat16]
"""
import sys, time, statistics, torch
from torch.profiler import profile, ProfilerActivity
from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import default_model
from pagedllm.worker import model_runner as mr
dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
llm = LLM(default_model(), dtype=dtype, max_model_len=2048, kv_cache_memory_bytes=2 << 30)
tok = llm.get_tokenizer()
prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write a short story about item {i}"}], add_generation_prompt=True, tokenize=False) for i in range(32)]
ids = [tok.encode(t, add_special_tokens=False) for t in prompts]
llm.generate([{"prompt_token_ids": ids[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
orig = mr.ModelRunner.execute_model
times, state = [], {"n": 0, "prof": None}
def wrapped(self, sched, non_block=False):
    n = state["n"]; state["n"] += 1
    if n == 40:
        state["prof"] = profile(activities=[ProfilerActivity.CPU]); state["prof"].__enter__()
    t = time.perf_counter(); r = orig(self, sched, non_block)
    if non_block: r.result()
    times.append(time.perf_counter() - t)
    if n == 71: state["prof"].__exit__(None, None, None)
    return r
mr.ModelRunner.execute_model = wrapped
t = time.perf_counter()
llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0, max_tokens=96, ignore_eos=True), use_tqdm=False)
el = time.perf_counter() - t
dec = times[1:40] + times[72:]
print(f"dtype {dtype} total {el:.2f}s steps {len(times)} prefill {times[0]*1e3:.0f} ms, decode median {statistics.median(dec)*1e3:.1f} ms, sum(steps) {sum(times):.2f}s")
print(state["prof"].key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
