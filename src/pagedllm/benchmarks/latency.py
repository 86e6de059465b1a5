"""Workload 2: decode latency (docs/benchmarks.md).

Dummy weights (bf16 on GPU), batch 1 and batch 32, prompt 128 random token ids, 256 output
tokens, temperature 0, ignore_eos. After a warm-up generate, each batch size is timed over
--num-iters iterations of two public-API calls: LLM.generate with max_tokens=1 (time to first
token: the prefill step) and with max_tokens=output_len (the whole request). The decode time
per step is the difference of the medians over the output_len - 1 decode steps:

    ms_per_step = (median(total) - median(ttft)) / (output_len - 1)

At batch 1 that is ms per output token; at batch B each step yields B tokens. For batch 1
the memory roofline is the weight bytes one token reads (from the config shape; of a MoE layer
only its top-k experts) over the device's measured copy bandwidth ((bytes read + bytes written)
/ time of copying a --copy-mib tensor, median of repeats, timed with CUDA events):
roofline_fraction = roofline_ms / ms_per_step. The step roofline (every batch size) counts every
byte a step reads instead (common.step_read_bytes: the weights as held, quantized ones packed with
their scales; of a MoE layer the experts the batch is expected to pick under uniform routing, as
dummy weights route, common.expected_experts; of the embedding only the rows looked up; each
request's K/V at its mean context over the decode, input_len + output_len / 2; --kv-cache-dtype
fp8: one byte per value):
step_roofline_fraction = step_roofline_ms / ms_per_step. The batch-1 roofline adds the K/V of
that mean context to the weights too (kv_bytes). Under tensor parallelism (--engine-args
tensor_parallel_size=N) both count what one rank reads (its shards of the projections, experts,
vocabulary and K/V heads; the ranks read at once), over one device's bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from pagedllm.benchmarks.common import (
    QUANTIZATIONS, SHAPES, emit, int_list, kv_bytes_per_token, kv_itemsize, parse_engine_args, print_table,
    quantization_setup, step_read_bytes, weight_bytes, write_shape,
)


def copy_bandwidth_bytes_per_s(device: str, nbytes: int, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth: (bytes read + bytes written) / time, median of repeats."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()  # never time zeros
    dst = torch.empty_like(src)
    times_s = []
    if src.is_cuda:
        for _ in range(3):
            dst.copy_(src)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times_s.append(start.elapsed_time(end) / 1e3)
    else:
        dst.copy_(src)
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times_s.append(time.perf_counter() - t0)
    del src, dst
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times_s)


def _time_generate(llm, prompts, params, iters: int) -> float:
    times_s = []
    for _ in range(iters):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)  # returns once tokens are on the host
        times_s.append(time.perf_counter() - t0)
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != [params.max_tokens] * len(prompts):
            raise RuntimeError(f"expected {params.max_tokens} tokens per request, got {got}")
    return statistics.median(times_s)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--model", help="a real model folder instead of a dummy shape (its config.json sizes the roofline)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 32], help="comma-separated, e.g. 1,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-iters", type=int, default=5, help="timed iterations of each call (median taken)")
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="the KV cache's dtype (fp8: 1 byte per element in the cache and the roofline)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the tensor copied to measure bandwidth")
    p.add_argument("--engine-args", default="", help="extra EngineArgs as k=v,k=v")
    p.add_argument("--quantization", default=None, choices=sorted(QUANTIZATIONS),
                   help="quantized weights: a dummy shape gets that format's quantization_config ('fp8': the "
                        "engine quantizes the 16-bit weights at load); the roofline counts packed weights and scales")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.output_len < 2:
        raise ValueError(f"--output-len must be >= 2 (decode steps follow the first token), got {args.output_len}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {args.batch_sizes}")

    import torch

    from pagedllm import LLM, SamplingParams, TokensPrompt

    shape_overrides, quantization = quantization_setup(args.quantization)
    if args.model and shape_overrides:
        raise ValueError(f"--quantization {args.quantization!r} describes a dummy shape's weights; a real --model "
                         "carries its own quantization_config")
    model = args.model or write_shape(args.shape, **shape_overrides)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    extra = parse_engine_args(args.engine_args)
    device = extra.get("device", "auto")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    itemsize = getattr(torch, dtype).itemsize
    # Before the engine takes its share of device memory.
    bandwidth = copy_bandwidth_bytes_per_s(device, args.copy_mib << 20)

    llm = LLM(model, load_format="auto" if args.model else "dummy", dtype=dtype, skip_tokenizer_init=not args.model,
              enforce_eager=args.enforce_eager, max_model_len=args.max_model_len, quantization=quantization,
              **{"kv_cache_dtype": args.kv_cache_dtype, **extra})
    kv_cache_dtype = extra.get("kv_cache_dtype", args.kv_cache_dtype)
    tp = int(extra.get("tensor_parallel_size", 1))  # the roofline counts what one rank reads
    kv_size = kv_itemsize(kv_cache_dtype, itemsize)
    rng = random.Random(0)
    results = []
    for batch in args.batch_sizes:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randint(0, 10000) for _ in range(args.input_len)])
                   for _ in range(batch)]
        full = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len, detokenize=False)
        first = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1, detokenize=False)
        for _ in range(args.num_iters_warmup):
            llm.generate(prompts, full, use_tqdm=False)
        ttft_s = _time_generate(llm, prompts, first, args.num_iters)
        total_s = _time_generate(llm, prompts, full, args.num_iters)
        step_ms = (total_s - ttft_s) * 1e3 / (args.output_len - 1)
        result = {"benchmark": "latency", "engine": "pagedllm", "shape": args.model or args.shape, "dtype": dtype,
                  "quantization": args.quantization, "kv_cache_dtype": kv_cache_dtype,
                  "enforce_eager": args.enforce_eager, "tensor_parallel_size": tp, "batch_size": batch,
                  "input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters,
                  "ttft_ms": round(ttft_s * 1e3, 2),
                  "e2e_s": round(total_s, 4), "ms_per_step": round(step_ms, 3),
                  "decode_tok_s": round(batch * 1e3 / step_ms, 1)}
        step_bytes = step_read_bytes(config, itemsize, batch, args.input_len + args.output_len / 2, kv_size,
                                     quantization, tp)
        step_roofline_ms = step_bytes / bandwidth * 1e3
        result.update(step_bytes=step_bytes, step_roofline_ms=round(step_roofline_ms, 3),
                      step_roofline_fraction=round(step_roofline_ms / step_ms, 3))
        if batch == 1:
            # MoE: one token reads its top-k experts; quantized projections: packed weights, scales, zeros.
            wbytes = weight_bytes(config, itemsize, active_only=True, quantization=quantization, tp=tp)
            kv_bytes = round((args.input_len + args.output_len / 2) * kv_bytes_per_token(config, kv_size, tp))
            roofline_ms = (wbytes + kv_bytes) / bandwidth * 1e3
            result.update(weight_bytes=wbytes, kv_bytes=kv_bytes, copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
                          roofline_ms=round(roofline_ms, 3), roofline_fraction=round(roofline_ms / step_ms, 3))
        emit(result)
        results.append(result)
    print_table(results, ["batch_size", "ttft_ms", "ms_per_step", "decode_tok_s", "roofline_ms", "roofline_fraction",
                          "step_roofline_ms", "step_roofline_fraction"])


if __name__ == "__main__":
    main()
