"""Where a CPU decode run's time goes, timed directly (no profiler): the linears, attention, the
RMSNorms, rotary and SiLU-and-mul, summed over one generate of 32 requests x N tokens after a
warm-up generate (issue 18). torch.profiler inflates the oneDNN linears about 2x here.

PYTHONPATH=src python scripts/cpu_step_parts.py [float32|bfloat16] [N] [--upcast]

--upcast attends bfloat16 decodes in float32 (with the upcast copies) even on CPUs with AMX.
"""
from __future__ import annotations

import sys
import time

from pagedllm import LLM, SamplingParams
from pagedllm.attention import torch_backend
from pagedllm.engine.arg_utils import default_model
from pagedllm.model import activations, layers, rotary
from pagedllm.worker import model_runner

dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
ntok = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 64
if "--upcast" in sys.argv:
    torch_backend.cpu_has_amx = lambda: False
llm = LLM(default_model(), dtype=dtype, max_model_len=2048, kv_cache_memory_bytes=2 << 30)
tok = llm.get_tokenizer()
chats = [[{"role": "user", "content": f"Write a short story about item {i}"}] for i in range(32)]
ids = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
       for c in chats]
params = SamplingParams(temperature=0, max_tokens=ntok, ignore_eos=True)
prompts = [{"prompt_token_ids": i} for i in ids]
llm.generate(prompts, params, use_tqdm=False)

spent = dict.fromkeys(["steps", "linears", "attention", "rms_norm", "rotary", "silu_mul"], 0.0)


def timed(owner, name: str, key: str) -> None:
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = real(*args, **kwargs)
        spent[key] += time.perf_counter() - t
        return out

    setattr(owner, name, wrapper)


timed(layers, "cpu_linear", "linears")
timed(torch_backend.TorchAttentionBackend, "forward", "attention")
timed(layers.RMSNorm, "forward", "rms_norm")
timed(rotary.RotaryEmbedding, "forward", "rotary")
timed(activations.SiluAndMul, "forward", "silu_mul")
timed(model_runner.ModelRunner, "execute_model", "steps")
t0 = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
total = time.perf_counter() - t0
print(f"{dtype} x {ntok} tokens{' (upcast)' if '--upcast' in sys.argv else ''}: {32 * ntok / total:.1f} out tok/s, "
      f"total {total:.2f} s; " + ", ".join(f"{k} {v:.2f} s" for k, v in spent.items()))
