"""GPU-only: steps that carry prefill chunks replay piecewise CUDA graphs (worker/piecewise_graphs.py)
and give transformers' greedy tokens in fp32, with chunked prefill, prefix hits, preemption and
async scheduling; their prompt logprobs, and seeded samples with n > 1, equal the eager forward's.
Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams, TokensPrompt
from tests.engine.test_correctness import hf_greedy, mixed_prompts, shared_prefix_prompts
from tests.gpu.test_gpu_engine import _greedy, _ids, _llm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_piecewise_steps_match_transformers_with_chunks_prefix_hits_and_preemption(tiny_models, arch, monkeypatch):
    prompts = shared_prefix_prompts() + mixed_prompts()
    llm = _llm(tiny_models[arch], monkeypatch, max_num_batched_tokens=96, num_gpu_blocks_override=12,
               max_model_len=160, async_scheduling=True)
    pieces = _runner(llm).graphs.piecewise
    assert pieces.sizes == [32, 64, 96]
    assert _ids(_greedy(llm, prompts)) == hf_greedy(tiny_models[arch], prompts)
    assert pieces.replays > 0 and llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks  # nothing held after the run


def test_piecewise_prompt_logprobs_and_seeded_n_samples_equal_the_eager_forward(tiny_models, monkeypatch):
    prompts = mixed_prompts(8)
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    runs, samples = [], []
    for tokens in ("2048", "0"):
        monkeypatch.setenv("PAGEDLLM_PIECEWISE_GRAPH_TOKENS", tokens)
        llm = _llm(tiny_models["qwen2"], monkeypatch, max_num_batched_tokens=128)
        outs = _greedy(llm, prompts, max_tokens=4, prompt_logprobs=0)
        pieces = _runner(llm).graphs.piecewise
        replays = pieces.replays if pieces is not None else None
        # n > 1: the children share the parent's prompt (prefix hits), chunks padded to the pieces
        samples.append([[c.token_ids for c in o.outputs] for o in llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in mixed_prompts(8, seed=5)], sampled, use_tqdm=False)])
        assert (pieces.replays > replays > 0) if tokens != "0" else pieces is None
        kv = llm.llm_engine.engine_core.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
        runs.append(outs)
        del llm
    assert samples[0] == samples[1] and all(len(set(map(tuple, s))) > 1 for s in samples[0])
    for prompt, graphed, eager in zip(prompts, *runs):
        assert graphed.outputs[0].token_ids == eager.outputs[0].token_ids
        for i in range(1, len(prompt)):  # padded rows change GEMM shapes, not the real rows' math
            a, b = graphed.prompt_logprobs[i][prompt[i]], eager.prompt_logprobs[i][prompt[i]]
            assert abs(a.logprob - b.logprob) < 1e-4
