"""Workload 5: the real SmolLM2-135M-Instruct on CPU, fp32 — pagedllm vs transformers `generate`.

32 chat requests ("Write a short story about item i"), max_tokens 128, temperature 0,
ignore_eos; transformers runs the same 32 prompts as one left-padded batch. Both in this run.
--temperature T samples instead (both engines, no top-k / top-p), as chat users do.
--model runs the same comparison on another model (a .gguf file or a Hugging Face folder).
"""
from __future__ import annotations

import argparse
import os
import time

from pagedllm.benchmarks.common import emit


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="a .gguf file or model folder (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the workload): greedy")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="for both engines; the workload is defined in float32")
    args = p.parse_args(argv)

    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.arg_utils import default_model

    model_path = args.model or default_model()
    is_gguf = model_path.endswith(".gguf")
    llm = LLM(model_path, dtype=args.dtype, max_model_len=args.max_model_len,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": f"Write a short story about item {i}"}] for i in range(args.num_requests)]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    prompt_ids = [tok.encode(t, add_special_tokens=False) for t in prompts]
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt_ids[0]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sp)
    ours_s = time.perf_counter() - start
    ours_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    model_name = "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized)" if args.model is None else args.model
    result = {"benchmark": "cpu_vs_hf", "model": model_name, "dtype": args.dtype, "temperature": args.temperature,
              "num_requests": args.num_requests, "torch_threads": torch.get_num_threads(),
              "pagedllm_output_tok_s": round(ours_tokens / ours_s, 1), "pagedllm_elapsed_s": round(ours_s, 2)}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        folder, gguf = (os.path.dirname(model_path), {"gguf_file": os.path.basename(model_path)}) if is_gguf else (
            model_path, {})
        model = AutoModelForCausalLM.from_pretrained(folder, **gguf, dtype=getattr(torch, args.dtype)).eval()
        tok.padding_side = "left"
        batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            model.generate(**{k: v[:1] for k, v in batch.items()}, max_new_tokens=2, do_sample=False,
                           pad_token_id=tok.pad_token_id)  # warm-up
            start = time.perf_counter()
            sampling = {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0} \
                if args.temperature > 0 else {"do_sample": False}
            gen = model.generate(**batch, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                 pad_token_id=tok.pad_token_id, **sampling)
            hf_s = time.perf_counter() - start
        hf_tokens = (gen.shape[1] - batch["input_ids"].shape[1]) * gen.shape[0]
        result.update(hf_output_tok_s=round(hf_tokens / hf_s, 1), hf_elapsed_s=round(hf_s, 2),
                      speedup=round((ours_tokens / ours_s) / (hf_tokens / hf_s), 2))
    emit(result)


if __name__ == "__main__":
    main()
