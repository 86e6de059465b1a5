"""Paired A/B in one process: pagedllm with oneDNN linears, pagedllm with F.linear (MKL), transformers
generate, interleaved rounds of 32 prompts x N tokens; prints per-round tok/s and medians.
Usage: PYTHONPATH=src python scripts/cpu_ab_paired.py DTYPE ROUNDS MAX_TOKENS
"""
import os, sys, time, statistics, torch
from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import default_model
from pagedllm.ops import cpu_linear
from transformers import AutoModelForCausalLM
dtype, rounds, ntok = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
path = default_model()
llm = LLM(path, dtype=dtype, max_model_len=2048, kv_cache_memory_bytes=2 << 30)
tok = llm.get_tokenizer()
prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write a short story about item {i}"}], add_generation_prompt=True, tokenize=False) for i in range(32)]
ids = [tok.encode(t, add_special_tokens=False) for t in prompts]
sp = SamplingParams(temperature=0, max_tokens=ntok, ignore_eos=True)
hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)).eval()
tok.padding_side = "left"
batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
def ours(enabled):
    cpu_linear._ENABLED = enabled
    t = time.perf_counter(); outs = llm.generate([{"prompt_token_ids": i} for i in ids], sp, use_tqdm=False)
    n = sum(len(o.outputs[0].token_ids) for o in outs); return n / (time.perf_counter() - t), outs
def theirs():
    with torch.no_grad():
        t = time.perf_counter()
        g = hf.generate(**batch, max_new_tokens=ntok, min_new_tokens=ntok, do_sample=False, pad_token_id=tok.pad_token_id)
    return (g.shape[1] - batch["input_ids"].shape[1]) * g.shape[0] / (time.perf_counter() - t)
ours(True); ours(False); theirs() if False else None
res = {"onednn": [], "mkl": [], "hf": []}
for r in range(rounds):
    a, oa = ours(True); b, ob = ours(False); c = theirs()
    same = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(oa, ob))
    res["onednn"].append(a); res["mkl"].append(b); res["hf"].append(c)
    print(f"round {r}: onednn {a:.1f} mkl {b:.1f} hf {c:.1f} tok/s; onednn/hf {a/c:.2f} mkl/hf {b/c:.2f}; identical outputs {same}/32; load {os.getloadavg()[0]:.1f}", flush=True)
med = {k: statistics.median(v) for k, v in res.items()}
ratios = lambda k: statistics.median([x / y for x, y in zip(res[k], res["hf"])])
print(f"MEDIAN dtype {dtype} threads {torch.get_num_threads()}: onednn {med['onednn']:.1f} mkl {med['mkl']:.1f} hf {med['hf']:.1f}; "
      f"median paired ratio onednn/hf {ratios('onednn'):.2f} mkl/hf {ratios('mkl'):.2f}")
