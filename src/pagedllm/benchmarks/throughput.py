"""Workload 1: offline throughput (docs/benchmarks.md).

256 requests, random.seed(0): prompts of randint(100, 1024) token ids from randint(0, 10000),
then max_tokens of randint(100, 1024); temperature 0.6, ignore_eos. One short warm-up, then
one timed LLM.generate. Run on CPU with a small --num-prompts and --shape tiny-llama.
"""
from __future__ import annotations

import argparse
import random
import time

from pagedllm.benchmarks.common import QUANTIZATIONS, SHAPES, emit, parse_engine_args, quantization_setup, write_shape


def draw_workload(num_prompts: int = 256, max_input_len: int = 1024,
                  max_output_len: int = 1024) -> tuple[list[list[int]], list[int]]:
    """Workload 1's requests: (prompt token ids, max_tokens), drawn as docs/benchmarks.md says
    (``random.seed(0)``; every prompt first, then every max_tokens)."""
    random.seed(0)
    lo_in, lo_out = min(100, max_input_len), min(100, max_output_len)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(lo_in, max_input_len))]
               for _ in range(num_prompts)]
    return prompts, [random.randint(lo_out, max_output_len) for _ in range(num_prompts)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--model", help="a real model instead of a dummy shape")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="the KV cache's dtype (fp8: 1 byte per element, twice the tokens of bf16 in the same memory)")
    p.add_argument("--engine-args", default="", help="extra EngineArgs as k=v,k=v (ints parsed)")
    p.add_argument("--quantization", default=None, choices=sorted(QUANTIZATIONS),
                   help="quantized weights: a dummy shape gets that format's quantization_config ('fp8': the "
                        "engine quantizes the 16-bit weights at load)")
    args = p.parse_args(argv)

    from pagedllm import LLM, SamplingParams, TokensPrompt

    prompts, max_tokens = draw_workload(args.num_prompts, args.max_input_len, args.max_output_len)

    extra = parse_engine_args(args.engine_args)
    shape_overrides, quantization = quantization_setup(args.quantization)
    if args.model and shape_overrides:
        raise ValueError(f"--quantization {args.quantization!r} describes a dummy shape's weights; a real --model "
                         "carries its own quantization_config")
    model = args.model or write_shape(args.shape, **shape_overrides)
    llm = LLM(model, load_format="auto" if args.model else "dummy", dtype=args.dtype,
              skip_tokenizer_init=not args.model, max_model_len=args.max_model_len, quantization=quantization,
              **{"kv_cache_dtype": args.kv_cache_dtype, **extra})
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, detokenize=False) for m in max_tokens]
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4, detokenize=False),
                 use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    kv_blocks = llm.llm_engine.engine_core.kv_cache_manager.num_blocks
    emit({"benchmark": "throughput", "engine": "pagedllm", "shape": args.model or args.shape,
          "kv_cache_dtype": extra.get("kv_cache_dtype", args.kv_cache_dtype), "num_kv_blocks": kv_blocks,
          "quantization": args.quantization,
          "num_prompts": args.num_prompts, "elapsed_s": round(elapsed, 2), "output_tokens": out_tokens,
          "output_tok_s": round(out_tokens / elapsed, 1), "total_tok_s": round((in_tokens + out_tokens) / elapsed, 1)})


if __name__ == "__main__":
    main()
