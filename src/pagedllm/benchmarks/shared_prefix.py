"""Long shared prefix (issue 19): prefix-cache hits and time to first token.

random.seed(0): one prefix of 6144 token ids from randint(0, 10000), then 64 requests, each
that prefix plus its own suffix of randint(32, 128) ids, then each max_tokens randint(16, 64);
temperature 0.6, ignore_eos, prefix caching on. After a warm-up request of other ids, the first
request runs alone (cold: it computes the prefix; ttft_cold_ms), then the other 63 in one timed
LLM.generate: hit rate (their prompt tokens served from the cache ÷ their prompt tokens; the
ideal is prefix ÷ (prefix + suffix), the prefix being whole blocks), TTFT p50 / p90 / p99,
total and output tok/s. `--engine-args enable_prefix_caching=false` is the same run without
the cache. Run on CPU with a small --prefix-len and --num-prompts and --shape tiny-llama.
"""
from __future__ import annotations

import argparse
import random
import time

from pagedllm.benchmarks.common import add_long_prompt_args, emit, engine_figures, parse_engine_args, ttft_figures, \
    warm_llm


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_long_prompt_args(p, num_prompts_help="requests, the cold first one included")
    p.add_argument("--prefix-len", type=int, default=6144)
    p.add_argument("--min-suffix-len", type=int, default=32)
    p.add_argument("--max-suffix-len", type=int, default=128)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.num_prompts < 2:
        raise ValueError(f"--num-prompts must be >= 2 (one cold request, then the timed ones), got {args.num_prompts}")
    if not 1 <= args.min_suffix_len <= args.max_suffix_len or not 1 <= args.min_output_len <= args.max_output_len:
        raise ValueError("need 1 <= --min-suffix-len <= --max-suffix-len and 1 <= --min-output-len <= --max-output-len")

    from pagedllm import SamplingParams, TokensPrompt

    random.seed(0)
    prefix = [random.randint(0, 10000) for _ in range(args.prefix_len)]
    prompts = [prefix + [random.randint(0, 10000) for _ in range(random.randint(args.min_suffix_len,
                                                                                args.max_suffix_len))]
               for _ in range(args.num_prompts)]
    max_tokens = [random.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_prompts)]
    warmup = [random.randint(10001, 20000) for _ in range(args.prefix_len + args.max_suffix_len)]

    extra = parse_engine_args(args.engine_args)
    llm = warm_llm(args, args.prefix_len + args.max_suffix_len + args.max_output_len, warmup,
                   **{"enable_prefix_caching": True, **extra})
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, detokenize=False) for m in max_tokens]
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    (cold,) = llm.generate(requests[:1], params[:1], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(requests[1:], params[1:], use_tqdm=False)
    elapsed = time.perf_counter() - start
    in_tokens = sum(len(p) for p in prompts[1:])
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    emit({"benchmark": "shared_prefix", "engine": "pagedllm", "shape": args.model or args.shape,
          "enable_prefix_caching": extra.get("enable_prefix_caching", True), "prefix_len": args.prefix_len,
          "num_prompts": args.num_prompts, "prompt_tokens": in_tokens, "output_tokens": out_tokens,
          "cached_prompt_tokens": cached, "hit_rate": round(cached / in_tokens, 4),
          "ideal_hit_rate": round(args.prefix_len * len(outs) / in_tokens, 4),
          "ttft_cold_ms": round((cold.metrics.first_token_time - cold.metrics.arrival_time) * 1e3, 2),
          **ttft_figures(outs), "elapsed_s": round(elapsed, 3),
          "total_tok_s": round((in_tokens + out_tokens) / elapsed, 1), "output_tok_s": round(out_tokens / elapsed, 1),
          **engine_figures(llm)})


if __name__ == "__main__":
    main()
