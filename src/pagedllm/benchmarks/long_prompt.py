"""Long prompts (issue 19): offline throughput when prefill dominates.

64 requests; random.seed(0): prompts of randint(4096, 8192) token ids from randint(0, 10000),
then max_tokens of randint(16, 64); temperature 0.6, ignore_eos. A warm-up request as long as
the longest prompt (its own ids), then one timed LLM.generate over all 64. Reports total tok/s
(prompt + output tokens over the wall time), output tok/s, and prefill tok/s: prompt tokens over
the time from the start to the last request's first token (by then every prompt is prefilled;
the decodes of earlier requests ride along in those steps, a few % of the tokens), with TTFT
p50 / p90 / p99. Prefix caching is on, as by default (random prompts share no block).
Run on CPU with a small --num-prompts, short lengths and --shape tiny-llama.
"""
from __future__ import annotations

import argparse
import random
import time

from pagedllm.benchmarks.common import add_long_prompt_args, emit, engine_figures, parse_engine_args, ttft_figures, \
    warm_llm


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_long_prompt_args(p)
    p.add_argument("--min-input-len", type=int, default=4096)
    p.add_argument("--max-input-len", type=int, default=8192)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if not 1 <= args.min_input_len <= args.max_input_len or not 1 <= args.min_output_len <= args.max_output_len:
        raise ValueError("need 1 <= --min-input-len <= --max-input-len and 1 <= --min-output-len <= --max-output-len")

    from pagedllm import SamplingParams, TokensPrompt

    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_prompts)]
    max_tokens = [random.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_prompts)]
    warmup = [random.randint(0, 10000) for _ in range(args.max_input_len)]

    llm = warm_llm(args, args.max_input_len + args.max_output_len, warmup, **parse_engine_args(args.engine_args))
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, detokenize=False) for m in max_tokens]
    start_wall, start = time.time(), time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    in_tokens = sum(len(p) for p in prompts)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prefill_s = max(o.metrics.first_token_time for o in outs) - start_wall
    emit({"benchmark": "long_prompt", "engine": "pagedllm", "shape": args.model or args.shape,
          "num_prompts": args.num_prompts, "prompt_tokens": in_tokens, "output_tokens": out_tokens,
          "elapsed_s": round(elapsed, 3), "total_tok_s": round((in_tokens + out_tokens) / elapsed, 1),
          "output_tok_s": round(out_tokens / elapsed, 1), "prefill_s": round(prefill_s, 3),
          "prefill_tok_s": round(in_tokens / prefill_s, 1), **ttft_figures(outs),
          "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs), **engine_figures(llm)})


if __name__ == "__main__":
    main()
