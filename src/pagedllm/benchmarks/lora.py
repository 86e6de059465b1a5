"""LoRA overhead: workload 1 with adapters against the same run without, and batch-1 decode.

Dummy base weights of a shape (default llama3-8b); ``--num-adapters`` random rank-``--rank``
adapters over all 7 projections, pushed from memory (``LLM.add_lora``), requests spread over
them evenly. In one process and one engine: workload 1 without adapters, then with; then
batch-1 decode (prompt 128, ``--output-len`` tokens, greedy) without and with one adapter.

    python -m pagedllm.benchmarks.lora [--shape llama3-8b] [--num-prompts 256] [--rank 16]
"""
from __future__ import annotations

import argparse
import random
import time

from pagedllm.benchmarks.common import SHAPES, emit, write_shape
from pagedllm.lora.peft_loader import TARGETS, expected_shapes


def random_adapter(hf_config, rank: int, seed: int):
    """A PEFT-named adapter in memory: (tensors, adapter_config) for every layer and projection."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for proj, (fan_in, fan_out) in expected_shapes(hf_config).items():
            where = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{where}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in ** -0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    return tensors, {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}


def push_random_adapters(llm, num_adapters: int, rank: int) -> list:
    """``num_adapters`` random adapters pushed from memory (``LLM.add_lora``, ids 1..n): the
    requests that name them."""
    from pagedllm import LoRARequest

    hf_config = llm.llm_engine.model_config.hf_config
    for i in range(num_adapters):
        tensors, cfg = random_adapter(hf_config, rank, seed=i)
        llm.add_lora(LoRARequest(f"a{i}", i + 1, tensors=tensors, peft_config=cfg))
    return [LoRARequest(f"a{i}", i + 1) for i in range(num_adapters)]


def _timed(llm, prompts, params, loras=None) -> tuple[float, int]:
    from pagedllm import TokensPrompt

    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128, help="batch-1 decode tokens")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)

    from pagedllm import LLM, SamplingParams

    llm = LLM(write_shape(args.shape), load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True,
              max_model_len=4096, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
    adapters = push_random_adapters(llm, args.num_adapters, args.rank)
    random.seed(0)
    lo_in, lo_out = min(100, args.max_input_len), min(100, args.max_output_len)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(lo_in, args.max_input_len))]
               for _ in range(args.num_prompts)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(lo_out, args.max_output_len),
                             detokenize=False) for _ in prompts]
    warm = SamplingParams(max_tokens=4, detokenize=False)
    _timed(llm, prompts[:2], warm, [adapters[0], None])
    base_s, base_tokens = _timed(llm, prompts, params)
    lora_s, lora_tokens = _timed(llm, prompts, params, [adapters[i % len(adapters)] for i in range(len(prompts))])
    one = [[random.randint(0, 10000) for _ in range(128)]]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len, detokenize=False)
    d_base = min(_timed(llm, one, greedy)[0] for _ in range(3))
    d_lora = min(_timed(llm, one, greedy, adapters[0])[0] for _ in range(3))
    emit({"benchmark": "lora", "shape": args.shape, "num_adapters": args.num_adapters, "rank": args.rank,
          "num_prompts": args.num_prompts, "base_output_tok_s": round(base_tokens / base_s, 1),
          "lora_output_tok_s": round(lora_tokens / lora_s, 1), "throughput_ratio": round(base_s / lora_s, 3),
          "batch1_ms_per_token_base": round(1e3 * d_base / args.output_len, 3),
          "batch1_ms_per_token_lora": round(1e3 * d_lora / args.output_len, 3),
          "batch1_overhead": round(d_lora / d_base - 1, 3)})


if __name__ == "__main__":
    main()
