"""Where a decode step's time goes under tensor parallelism: the latency workload (dummy
weights, prompts of 128 random ids, greedy, ignore_eos) at one batch size, every worker
profiled through LLM.start_profile() / stop_profile(); prints each rank's summary (wall time,
device busy time, ops by device time) and the engine's ms per step.

PAGEDLLM_TORCH_PROFILER_DIR=/tmp/prof python scripts/profile_tp.py --shape llama3-8b --tp 2 --batch 32
"""
from __future__ import annotations

import argparse
import random
import time

from pagedllm import LLM, SamplingParams, TokensPrompt, envs
from pagedllm.benchmarks.common import parse_engine_args, write_shape

def time_engine_phases(llm: LLM) -> dict[str, float]:
    """Seconds the engine process spends in each phase of its steps, from now (wrapped methods)."""
    core = llm.llm_engine.engine_core
    spent = {"steps": 0, "step": 0.0, "schedule": 0.0, "update_from_output": 0.0, "send": 0.0, "gather": 0.0}

    def timed(obj, attr: str, key: str) -> None:
        inner = getattr(obj, attr)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
                if key == "step":
                    spent["steps"] += 1
        setattr(obj, attr, wrapper)

    timed(core, "step", "step")
    timed(core.scheduler, "schedule", "schedule")
    timed(core.scheduler, "update_from_output", "update_from_output")
    if hasattr(core.executor, "_send"):
        timed(core.executor, "_send", "send")
        timed(core.executor, "_gather", "gather")
    return spent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--engine-args", default="")
    args = p.parse_args()
    if not envs.PAGEDLLM_TORCH_PROFILER_DIR:
        raise SystemExit("set PAGEDLLM_TORCH_PROFILER_DIR")
    llm = LLM(write_shape(args.shape), load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=args.tp,
              max_model_len=4096, **parse_engine_args(args.engine_args))
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randint(0, 10000) for _ in range(128)]) for _ in range(args.batch)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    first = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1, detokenize=False)
    t = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    ttft = time.perf_counter() - t
    spent = time_engine_phases(llm)
    llm.start_profile()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t
    spent = dict(spent)  # before stop_profile's call to the workers (its trace export) counts too
    paths = llm.stop_profile()
    steps = spent.pop("steps")
    print("engine process, ms per step: " + ", ".join(f"{k} {v * 1e3 / steps:.3f}" for k, v in spent.items()))
    print(f"batch {args.batch}: {(total - ttft) * 1e3 / (args.output_len - 1):.3f} ms per decode step "
          f"(profiled; ttft {ttft * 1e3:.1f} ms)")
    for path in paths:
        print(open(path).read())


if __name__ == "__main__":  # the worker processes are spawned: they import this file
    main()
