"""What bounds workload 1 on a shape: KV capacity (blocks, requests held at once, preemptions)
or step time (by the number of requests decoding). Records every scheduled step of a throughput
run and prints a short summary. No profiler, so the timing is the run's own.

python scripts/throughput_probe.py [--shape qwen3-30b-a3b] [--num-prompts 256] [--engine-args k=v,...]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.benchmarks.common import parse_engine_args, write_shape
from pagedllm.benchmarks.throughput import draw_workload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--engine-args", default="")
    args = p.parse_args()
    prompts, max_tokens = draw_workload(args.num_prompts)
    llm = LLM(write_shape(args.shape), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              **parse_engine_args(args.engine_args))
    core = llm.llm_engine.engine_core
    kv = core.kv_cache_manager
    mem = "" if not torch.cuda.is_available() else (
        f"; GPU allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB "
          f"of {torch.cuda.get_device_properties(0).total_memory / 2**30:.2f}")
    print(f"KV blocks {kv.num_blocks} x block {kv.block_size}{mem}")
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, detokenize=False) for m in max_tokens]
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4, detokenize=False),
                 use_tqdm=False)
    sched = core.scheduler
    rows: list[tuple[float, int, int, int]] = []  # (time, scheduled tokens, requests, prefill requests)
    prefill_tokens = [0]
    orig = sched.schedule

    def schedule():
        out = orig()
        prefills = len(out.scheduled_new_reqs) + sum(
            1 for c in out.scheduled_cached_reqs if out.num_scheduled_tokens.get(c.req_id, 0) > 1)
        rows.append((time.perf_counter(), out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), prefills))
        prefill_tokens[0] += sum(n for n in out.num_scheduled_tokens.values() if n > 1)
        return out

    sched.schedule = schedule
    compiles: list[tuple[float, str]] = []  # Triton compiling in the timed run stalls the host
    try:
        import triton

        triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiles.append(
            (time.perf_counter(), kw["fn"].name)) and None
    except (ImportError, AttributeError):
        pass
    pre0 = sched.num_preemptions
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"wall {wall:.2f} s, {n_out / wall:.1f} out tok/s, steps {len(rows)}, preemptions {sched.num_preemptions - pre0}; "
          f"prefill tokens run {prefill_tokens[0]} for {sum(map(len, prompts))} prompt tokens")
    by_batch: dict[int, list[float]] = defaultdict(list)
    by_tokens: dict[int, list[float]] = defaultdict(list)  # prefill-bearing steps by scheduled tokens
    t_prefill = t_decode = 0.0
    weighted = 0.0
    for (t, tokens, reqs, pre), (t_next, *_) in zip(rows, rows[1:] + [(t0 + wall, 0, 0, 0)]):
        d = t_next - t
        weighted += reqs * d
        if pre:
            t_prefill += d
            by_tokens[next(b for b in (512, 2048, 8192, 1 << 30) if tokens <= b)].append(d)
        else:
            t_decode += d
            by_batch[(reqs + 15) // 16 * 16].append(d)
    print(f"Triton compiles in the run: {len(compiles)} " + " ".join(f"{t - t0:.2f}s:{n}" for t, n in compiles[:12]))
    gaps = [(t_next - t, t - t0, tokens, reqs) for (t, tokens, reqs, _), (t_next, *_) in zip(rows, rows[1:])]
    print("slowest steps (ms @ s: tokens/requests): " + " ".join(
        f"{d * 1e3:.0f}@{at:.1f}:{tok}/{r}" for d, at, tok, r in sorted(gaps, reverse=True)[:10]))
    print(f"time in steps with a prefill: {t_prefill:.2f} s; decode-only: {t_decode:.2f} s; "
          f"time-weighted requests a step {weighted / wall:.1f}")
    for b in sorted(by_tokens):
        ds = by_tokens[b]
        print(f"  steps with a prefill, up to {b if b < 1 << 30 else 'more'} tokens: {len(ds):4d} steps, "
              f"total {sum(ds):6.2f} s")
    for b in sorted(by_batch):
        ds = sorted(by_batch[b])
        print(f"  decode-only steps of {b - 15:3d}-{b:3d} requests: {len(ds):5d} steps, median {ds[len(ds) // 2] * 1e3:6.2f} ms, "
              f"total {sum(ds):6.2f} s")


if __name__ == "__main__":
    main()
