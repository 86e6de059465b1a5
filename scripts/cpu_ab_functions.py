"""In-process A/B of the CPU decode's torch paths: an older revision's
TorchAttentionBackend._decode, RotaryEmbedding.forward and RMSNorm._norm (read with `git show`)
against the working tree's, alternated per round on one engine (SmolLM2, 32 chat prompts, greedy).
Prints per-round tok/s, how many outputs are identical, and the median new/old ratio.

Usage: PYTHONPATH=src python scripts/cpu_ab_functions.py REV [float32|bfloat16] [ROUNDS] [MAX_TOKENS]
"""
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

from pagedllm import LLM, SamplingParams
from pagedllm.attention import torch_backend
from pagedllm.engine.arg_utils import default_model
from pagedllm.model import layers, rotary

FILES = {"torch_backend": "src/pagedllm/attention/torch_backend.py", "rotary": "src/pagedllm/model/rotary.py",
         "layers": "src/pagedllm/model/layers.py"}


def old_modules(rev: str) -> dict:
    out, tmp = {}, tempfile.mkdtemp()
    for name, path in FILES.items():
        src = subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout
        file = os.path.join(tmp, f"old_{name}.py")
        with open(file, "w") as f:
            f.write(src)
        spec = importlib.util.spec_from_file_location(f"old_{name}", file)
        out[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(out[name])
    return out


def main() -> None:
    rev = sys.argv[1]
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    old = old_modules(rev)
    new_fns = (torch_backend.TorchAttentionBackend._decode, rotary.RotaryEmbedding.forward, layers.RMSNorm._norm)
    old_fns = (old["torch_backend"].TorchAttentionBackend._decode, old["rotary"].RotaryEmbedding.forward,
               old["layers"].RMSNorm._norm)

    def use(fns):
        torch_backend.TorchAttentionBackend._decode, rotary.RotaryEmbedding.forward, layers.RMSNorm._norm = fns

    llm = LLM(default_model(), dtype=dtype, max_model_len=2048, kv_cache_memory_bytes=2 << 30)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write a short story about item {i}"}],
                                       add_generation_prompt=True, tokenize=False) for i in range(32)]
    ids = [{"prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(fns):
        use(fns)
        t = time.perf_counter()
        outs = llm.generate(ids, params, use_tqdm=False)
        rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
        return rate, [o.outputs[0].token_ids for o in outs]

    run(old_fns)
    run(new_fns)
    ratios = []
    for r in range(rounds):
        a, out_a = run(old_fns)
        b, out_b = run(new_fns)
        same = sum(x == y for x, y in zip(out_a, out_b))
        ratios.append(b / a)
        print(f"round {r}: old {a:.1f} new {b:.1f} tok/s, new/old {b / a:.3f}, identical {same}/32, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"MEDIAN new/old {statistics.median(ratios):.3f} ({dtype}, {rev} against the working tree)")


if __name__ == "__main__":
    main()
