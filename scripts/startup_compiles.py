"""Which Triton kernels a start-up compiles, and how long each takes (fresh cache dir).

python scripts/startup_compiles.py [--shape llama3-8b]
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

if __name__ == "__main__":
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    import triton

    starts: dict = {}
    rows: list = []

    def pre(**kw):
        starts[id(kw["compile"]["key"])] = time.perf_counter()
        return None

    def post(**kw):
        c = kw["compile"]
        consts = {k[0] if isinstance(k, tuple) else k: v for k, v in c["constants"].items()}
        rows.append((time.perf_counter() - starts.get(id(c["key"]), time.perf_counter()), kw["fn"].name,
                     c["num_warps"], c["num_stages"], str(sorted(consts.items()))[:150]))
        return None

    triton.knobs.runtime.jit_cache_hook = pre
    triton.knobs.runtime.jit_post_compile_hook = post
    from pagedllm import LLM, SamplingParams, TokensPrompt
    from pagedllm.benchmarks.common import write_shape

    shape = sys.argv[sys.argv.index("--shape") + 1] if "--shape" in sys.argv else "llama3-8b"
    t0 = time.perf_counter()
    llm = LLM(write_shape(shape), load_format="dummy", skip_tokenizer_init=True)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    print(f"start-up with an empty Triton cache: {time.perf_counter() - t0:.1f} s; {len(rows)} compiles, "
          f"{sum(r[0] for r in rows):.1f} s")
    for r in rows:
        print(f"{r[0]:6.2f} s  {r[1]:<28} w{r[2]} s{r[3]}  {r[4]}")
