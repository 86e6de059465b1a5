"""A few launches of the Triton paged attention per case, for Nsight Compute (issue 17's fp8 KV,
issue 19's prefill).

    ncu --set full -k regex:_attention_kernel -s 2 -c 1 python scripts/attention_ncu.py CASE[,CASE...]
    ncu --set full -k regex:_prefill_kernel -s 2 -c 1 python scripts/attention_ncu.py l8b_p8k_bf16

CASE: l8b_b32_bf16 / l8b_b32_fp8 (llama3-8b heads, 32 sequences x 384 tokens), q06_b256_bf16 /
q06_b256_fp8 (qwen3-0.6b heads, 256 x 1,024) decode; l8b_p8k_bf16 (one fresh 8,192-token prompt,
llama3-8b heads: the prefill kernel); random paged caches as in ``pagedllm.attention.kernel_bench``.
Each case runs the KV write and attention three times (ncu's ``-s 2`` skips the first two attention
launches: compile and warm-up)."""
from __future__ import annotations

import sys

import torch

from pagedllm.attention import kernel_bench as kb
from pagedllm.attention.kv_quant import FP8_KV_DTYPES

CASES = {"l8b_b32_bf16": ("llama3-8b", 32, 384, None), "l8b_b32_fp8": ("llama3-8b", 32, 384, "fp8_e4m3"),
         "q06_b256_bf16": ("qwen3-0.6b", 256, 1024, None), "q06_b256_fp8": ("qwen3-0.6b", 256, 1024, "fp8_e4m3"),
         "l8b_p8k_bf16": ("llama3-8b", 1, 8192, None)}


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    for name in sys.argv[1].split(","):
        shape, batch, ctx, kv_dtype = CASES[name]
        heads, kv_heads, head_dim = kb.SHAPES[shape]
        runs = [(0, ctx)] if batch == 1 else [(ctx - 1, 1)] * batch  # one fresh prompt, or decodes
        case = kb.make_case(heads, kv_heads, head_dim, runs, torch.bfloat16, gen,
                            kv_dtype=FP8_KV_DTYPES[kv_dtype] if kv_dtype else None)
        for _ in range(3):
            kb.run(case)
        torch.cuda.synchronize()
        print(name, "done", flush=True)


if __name__ == "__main__":
    main()
