"""GPU-only: start-up compiles its Triton kernels in the compile pool (pagedllm.ops.precompile),
not in the engine process. A fresh process with an empty Triton cache starts a bf16 engine
(CUDA graphs on): with the pool, the engine process itself compiles nothing during start-up
(every kernel comes from the cache the pool filled); without it (PAGEDLLM_PARALLEL_COMPILE=0)
it compiles them all. Outputs are the same either way. A second pooled start-up on the same
caches reads the jobs the first one kept instead of running the dry run, and compiles nothing
in place either."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

_CHILD = r"""
import json, sys, triton
from pagedllm import LLM, SamplingParams
from pagedllm.ops import precompile
hits, in_place, specs = [], [], []
triton.knobs.compilation.listener = lambda src, cache_hit, **kw: hits.append(cache_hit)
def post(*, fn, compile, **kw):
    if not hits[-1]:
        in_place.append(fn.name)
        specs.append(compile["specialization_data"])
triton.knobs.runtime.jit_post_compile_hook = post
llm = LLM(sys.argv[1], dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=256)
# For a failure message: how each kernel compiled in place differs from the dry run's records of it.
diffs = []
for spec in specs:
    mine = json.loads(spec)
    for other in map(json.loads, precompile.LAST_SPECS):
        if other["name"] == mine["name"]:
            diffs.append({k: (mine[k], other[k]) for k in mine if mine[k] != other[k] and k != "key"})

outs = llm.generate(["The capital of France is", "1 2 3 4"], SamplingParams(temperature=0, max_tokens=12),
                    use_tqdm=False)
print("RESULT " + json.dumps({"in_place": in_place, "diffs": diffs, "ids": [o.outputs[0].token_ids for o in outs]}))
"""


def _start(model: str, cache_dir, parallel: bool) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), PAGEDLLM_PARALLEL_COMPILE="1" if parallel else "0",
               PAGEDLLM_CACHE_DIR=str(cache_dir / "pagedllm"), PAGEDLLM_LOGGING_LEVEL="DEBUG")
    out = subprocess.run([sys.executable, "-c", _CHILD, model], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]) | {"log": out.stderr}


def test_start_up_compiles_in_the_pool(tiny_models, tmp_path):
    pooled = _start(tiny_models["qwen3"], tmp_path / "pooled", parallel=True)
    assert "Compiled" in pooled["log"] and "in place" not in pooled["log"], pooled["log"][-2000:]
    assert pooled["in_place"] == [], "compiled in place: " + json.dumps([pooled["in_place"], pooled["diffs"][:6]])
    serial = _start(tiny_models["qwen3"], tmp_path / "serial", parallel=False)
    assert len(serial["in_place"]) >= 8  # norms, rotary, KV write, attention shapes, GEMMs, sampler
    # Only the largest graph of each set warms up eagerly: the other sizes load or compile their
    # kernel variants inside their capture (CudaGraphs.capture).
    assert "in pieces at" in serial["log"], serial["log"][-2000:]
    assert pooled["ids"] == serial["ids"]
    assert "(dry run" in pooled["log"]
    again = _start(tiny_models["qwen3"], tmp_path / "pooled", parallel=True)
    assert "Triton kernels all cached (kept jobs looked up" in again["log"], again["log"][-2000:]
    assert again["in_place"] == [] and again["ids"] == pooled["ids"]
