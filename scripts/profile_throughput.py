"""Where the time of the throughput workload goes on a GPU: kernel time by kernel, and
device busy time against wall time (host-bound or device-bound). A reduced workload.

python scripts/profile_throughput.py [--num-prompts 256] [--shape qwen3-0.6b] [--long]
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.benchmarks.common import write_shape
from pagedllm.benchmarks.throughput import draw_workload

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen3-0.6b")
p.add_argument("--num-prompts", type=int, default=256)
p.add_argument("--max-len", type=int, default=1024)
p.add_argument("--engine-args", default="")
p.add_argument("--host", action="store_true", help="no torch profiler: sample the host's Python stacks instead")
p.add_argument("--long", action="store_true", help="workload 7 instead (long prompts: 4,096-8,192 tokens, 16-64 out)")
args = p.parse_args()
extra = {}
for kv in filter(None, args.engine_args.split(",")):
    k, v = kv.split("=")
    extra[k] = int(v) if v.lstrip("-").isdigit() else (v == "true" if v in ("true", "false") else v)
if args.long:
    import random

    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(4096, 8192))] for _ in range(args.num_prompts)]
    max_tokens = [random.randint(16, 64) for _ in range(args.num_prompts)]
else:
    prompts, max_tokens = draw_workload(args.num_prompts, args.max_len, args.max_len)
llm = LLM(write_shape(args.shape), load_format="dummy", skip_tokenizer_init=True,
          max_model_len=8256 if args.long else 4096, **extra)
params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, detokenize=False) for m in max_tokens]
llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)
engine = llm.llm_engine
steps = {"n": 0}
step_times: list[tuple[float, float]] = []  # (start offset, host seconds) per engine step
orig_step = engine.engine_core.step
T0 = [0.0]


def timed_step():
    steps["n"] += 1
    t = time.perf_counter()
    try:
        return orig_step()
    finally:
        step_times.append((t - T0[0], time.perf_counter() - t))


engine.engine_core.step = timed_step
# What can stall the host in the middle of a run: Triton compiling a new kernel variant, and
# Python's garbage collector.
import gc  # noqa: E402

import triton  # noqa: E402

compiles: list[tuple[float, str]] = []
triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiles.append(
    (time.perf_counter() - T0[0], kw["fn"].name)) and None
gc_pauses: list[tuple[float, float, int]] = []
_gc_t = [0.0]


def _gc_cb(phase, info):
    if phase == "start":
        _gc_t[0] = time.perf_counter()
    else:
        gc_pauses.append((_gc_t[0] - T0[0], time.perf_counter() - _gc_t[0], info.get("generation", -1)))


gc.callbacks.append(_gc_cb)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

if args.host:
    import contextlib
    import sys

    sys.path.insert(0, "scripts")
    from host_sampler import HostSampler

    sampler = HostSampler()
    prof_ctx = contextlib.nullcontext()
else:
    prof_ctx = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
with prof_ctx as prof:
    if args.host:
        sampler.start()
    t0 = T0[0] = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if args.host:
        sampler.stop()
n_out = sum(len(o.outputs[0].token_ids) for o in outs)
gc_pauses = [g for g in gc_pauses if 0 <= g[0] <= wall]
slow = sorted(step_times, key=lambda x: -x[1])[:12]
print(f"engine steps: {len(step_times)}, host {sum(d for _, d in step_times):.2f} s; slowest (at s, ms): "
      + " ".join(f"{t:.2f}:{d * 1e3:.0f}" for t, d in slow))
print(f"Triton compiles during the run: {len(compiles)} " + " ".join(f"{t:.2f}s:{n}" for t, n in compiles[:10]))
print(f"GC pauses in the run: {len(gc_pauses)}, {sum(d for _, d, _ in gc_pauses) * 1e3:.0f} ms; gen2 "
      f"{sum(1 for *_, g in gc_pauses if g == 2)}; largest: "
      + " ".join(f"{t:.2f}s:{d * 1e3:.0f}ms/g{g}" for t, d, g in sorted(gc_pauses, key=lambda x: -x[1])[:6]))
if args.host:
    off = T0[0] - sampler.t0  # sampler times are from its start, just before T0
    sampler.report(0, 1.0, "first second (prefill burst)")
    for t, d in slow[:2]:
        sampler.report(t - off, t - off + d, f"slow step at {t:.2f} s ({d * 1e3:.0f} ms)")
    sampler.report(2.5, 6.0, "steady decode 2.5-6 s")
    raise SystemExit(0)
events = prof.key_averages()
kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
cuda_total = sum(e.self_device_time_total for e in kernels) / 1e6
print(f"wall {wall:.2f} s (profiled), steps {steps['n']}, out tokens {n_out}, {n_out / wall:.0f} tok/s; "
      f"device kernel time {cuda_total:.2f} s ({100 * cuda_total / wall:.0f}% of wall)")
rows = sorted(kernels, key=lambda e: -e.self_device_time_total)[:18]
for e in rows:
    if e.self_device_time_total <= 0:
        continue
    print(f"{e.self_device_time_total / 1e6:8.3f} s  {e.count:7d}x  {e.key[:110]}")
print("-- host (self CPU) top")
for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
    print(f"{e.self_cpu_time_total / 1e6:8.3f} s  {e.count:7d}x  {e.key[:110]}")

# GPU idle gaps over the run, by tenths of the kernel timeline (host-bound phases show up).
spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
if spans:
    t_start, t_end = spans[0][0], max(end for _, end in spans)
    width = (t_end - t_start) / 10
    idle = [0.0] * 10
    busy_until = spans[0][0]
    for start, end in spans:
        if start > busy_until:
            idle[min(int((busy_until - t_start) / width), 9)] += start - busy_until
        busy_until = max(busy_until, end)
    print("GPU idle per tenth of the run (ms): " + " ".join(f"{x / 1e3:.0f}" for x in idle)
          + f"  (total {sum(idle) / 1e6:.2f} s of {(t_end - t_start) / 1e6:.2f} s)")
    gaps = []
    busy_until = spans[0][0]
    for start, end in spans:
        if start - busy_until > 3000:  # us
            gaps.append(((busy_until - t_start) / 1e6, (start - busy_until) / 1e3))
        busy_until = max(busy_until, end)
    print(f"GPU idle gaps > 3 ms: {len(gaps)}, {sum(g for _, g in gaps):.0f} ms; largest (at s, ms): "
          + " ".join(f"{a:.2f}:{g:.0f}" for a, g in sorted(gaps, key=lambda x: -x[1])[:12]))
