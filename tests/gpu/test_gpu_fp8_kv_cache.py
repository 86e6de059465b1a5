"""GPU-only: the FP8 KV cache through the Triton kernels and CUDA graphs. The decode graphs are
captured before calculate_kv_scales sets the scales (first step): replays read the new values
(the kernels take the scales by pointer), so graphs and eager steps give the same tokens, and
both equal the torch backend's fp8 run (fp32 model); in bfloat16 the logprobs stay near the
bf16 cache's. Skipped without CUDA (the CPU suite's tests/engine/test_fp8_kv_cache.py runs on
the GPU machine too, through the Triton backend)."""
from __future__ import annotations

import statistics

import pytest
import torch

from tests.engine.test_correctness import mixed_prompts, shared_prefix_prompts
from tests.gpu.test_gpu_engine import _greedy, _ids, _llm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _scales(llm):
    return [layer.kv_scale.tolist() for layer in llm.llm_engine.engine_core.executor.worker.model_runner.attn_layers]


@pytest.mark.parametrize("cache", ["fp8", "fp8_e5m2"])
def test_graphs_eager_and_torch_backend_agree_with_an_fp8_cache(tiny_models, cache, monkeypatch):
    prompts = mixed_prompts() + shared_prefix_prompts()
    kwargs = dict(kv_cache_dtype=cache, calculate_kv_scales=True)
    graphs = _llm(tiny_models["qwen3"], monkeypatch, **kwargs)
    runner = graphs.llm_engine.engine_core.executor.worker.model_runner
    assert runner.attn_backend.name == "triton" and runner.cuda_graphs
    assert runner.kv_caches[0].dtype == {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[cache]
    got = _ids(_greedy(graphs, prompts))
    assert all(s != 1.0 for layer in _scales(graphs) for s in layer)
    del graphs
    eager = _llm(tiny_models["qwen3"], monkeypatch, enforce_eager=True, **kwargs)
    assert _ids(_greedy(eager, prompts)) == got
    del eager
    reference = _llm(tiny_models["qwen3"], monkeypatch, backend="torch", **kwargs)
    assert _ids(_greedy(reference, prompts)) == got


def test_bf16_logprobs_with_an_fp8_cache_stay_near_the_bf16_cache(smollm2_gguf, monkeypatch):
    prompts = ["The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
               "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    lps = []
    for kwargs in ({}, dict(kv_cache_dtype="fp8", calculate_kv_scales=True)):
        llm = _llm(smollm2_gguf, monkeypatch, dtype="bfloat16", max_model_len=512, **kwargs)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        lps.append([e[t].logprob for o in outs for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
        del llm
    diffs = [abs(a - b) for a, b in zip(*lps)]
    assert statistics.mean(diffs) < 0.15 and max(diffs) < 1.0, (statistics.mean(diffs), max(diffs))
