"""GPU-only: the Triton backend and CUDA graphs give the same greedy tokens as the torch
reference backend and transformers (fp32), and stay within bf16 tolerance in bf16.

Skipped without CUDA. The CPU suite (tests/engine) also runs on the GPU machine, where
every LLM picks the Triton backend and captures CUDA graphs."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.conftest import TINY_ARCHS, build_tiny_model
from tests.engine.test_correctness import hf_greedy, hf_logprobs, mixed_prompts, shared_prefix_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MAX_TOKENS = 12


def _llm(model_dir, monkeypatch, backend="triton", **kwargs):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)
    kwargs.setdefault("dtype", "float32")
    # A fixed cache size: engines of earlier tests may not be collected yet.
    kwargs.setdefault("kv_cache_memory_bytes", 512 * 2**20)
    return LLM(model_dir, seed=0, device="cuda", **kwargs)


def _greedy(llm, prompts, max_tokens=MAX_TOKENS, **params):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return outs


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_triton_backend_and_cuda_graphs_match_torch_backend_and_transformers_fp32(tiny_models, arch, monkeypatch):
    prompts = mixed_prompts() + shared_prefix_prompts()
    ref = hf_greedy(tiny_models[arch], prompts)
    fast = _llm(tiny_models[arch], monkeypatch)
    runner = fast.llm_engine.engine_core.executor.worker.model_runner
    assert runner.attn_backend.name == "triton" and runner.cuda_graphs, "expected Triton + CUDA graphs"
    assert _ids(_greedy(fast, prompts)) == ref
    assert runner.graphs.piecewise.replays > 0  # the prefill steps replayed piecewise graphs
    del fast
    eager = _llm(tiny_models[arch], monkeypatch, enforce_eager=True, max_num_batched_tokens=32, block_size=8)
    assert not eager.llm_engine.engine_core.executor.worker.model_runner.cuda_graphs
    assert _ids(_greedy(eager, prompts)) == ref  # chunked prefill + prefix hits, no graphs
    del eager
    torch_ref = _llm(tiny_models[arch], monkeypatch, backend="torch")
    assert _ids(_greedy(torch_ref, prompts)) == ref


def test_preemption_on_gpu_matches_transformers(tiny_models, monkeypatch):
    prompts = shared_prefix_prompts() + mixed_prompts()
    llm = _llm(tiny_models["qwen3"], monkeypatch, num_gpu_blocks_override=10, max_model_len=160,
               max_num_batched_tokens=32)
    assert _ids(_greedy(llm, prompts)) == hf_greedy(tiny_models["qwen3"], prompts)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logprobs_within_tolerance(tiny_models, dtype, monkeypatch):
    """Prompt logprobs in bf16/fp16 against transformers fp32: half-precision tolerance."""
    model_dir = tiny_models["llama"]
    llm = _llm(model_dir, monkeypatch, dtype=dtype)
    prompts = mixed_prompts()[:6]
    outs = _greedy(llm, prompts, max_tokens=4, prompt_logprobs=0)
    errors = []
    for prompt, out in zip(prompts, outs):
        ref = hf_logprobs(model_dir, tuple(prompt + out.outputs[0].token_ids))
        for i in range(1, len(prompt)):
            lp = out.prompt_logprobs[i][prompt[i]].logprob
            errors.append(abs(lp - ref[i - 1][prompt[i]].item()))
    # bf16 keeps 8 mantissa bits: on this tiny model's sharp logits (|logprob| up to ~20) a
    # position can move by ~0.2 (seen: 0.19); on average far less. fp16 keeps 11 bits.
    mean_bound, max_bound = (0.05, 0.3) if dtype == "bfloat16" else (0.01, 0.06)
    assert sum(errors) / len(errors) < mean_bound and max(errors) < max_bound, (sum(errors) / len(errors), max(errors))


def test_graph_replay_handles_every_padded_batch_size(tiny_models, monkeypatch):
    """Batches of 1..20 decodes (padded to the captured sizes) give per-request results
    identical to running each request alone."""
    llm = _llm(tiny_models["qwen2"], monkeypatch, max_num_seqs=20)
    prompts = mixed_prompts() * 2
    alone = [_ids(_greedy(llm, [p]))[0] for p in prompts[:10]]
    for n in (1, 3, 7, 13, 20):
        got = _ids(_greedy(llm, prompts[:n]))
        assert got == (alone * 2)[:n]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon prefill kernel runs on Hopper")
def test_the_gluon_prefill_kernel_in_the_engine_matches_transformers_and_the_triton_kernel(
        tmp_path, smollm2_tokenizer_dir, monkeypatch):
    """fp16 prompts of 77-450 tokens on a head_dim-128 model, in chunks of at most 256 tokens and with prefix-cache
    hits: prompt logprobs within fp16 tolerance of transformers fp32 with the Gluon prefill kernel and with the
    Triton one (PAGEDLLM_GLUON_PREFILL=0), and of each other; the Gluon kernel taken only when on. (The torch
    backend on a CPU, same model and prompts: mean 0.0038, max 0.028 from transformers; the logprobs spread with a
    standard deviation of 1.6.)"""
    from pagedllm.attention import triton_prefill

    model_dir = build_tiny_model("llama", str(tmp_path), smollm2_tokenizer_dir, hidden_size=256, initializer_range=0.1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 1000) for _ in range(160)]
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (300, 170, 77, 450)]
    prompts += [prefix + [rng.randrange(3, 1000) for _ in range(n)] for n in (90, 130, 40)]
    refs = [hf_logprobs(model_dir, tuple(prompt)) for prompt in prompts]
    gluon = triton_prefill._gluon_prefill()
    calls, real = [], gluon.prefill_attention_ws
    monkeypatch.setattr(gluon, "prefill_attention_ws", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    got = {}
    for on in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_GLUON_PREFILL", on)
        calls.clear()
        llm = _llm(model_dir, monkeypatch, dtype="float16", max_num_batched_tokens=256)
        outs = _greedy(llm, prompts, max_tokens=2, prompt_logprobs=0)
        assert bool(calls) == (on == "1"), (on, calls)
        got[on] = [out.prompt_logprobs[i][prompt[i]].logprob for prompt, out in zip(prompts, outs)
                   for i in range(1, len(prompt))]
        del llm
    ref = [r[i - 1][prompt[i]].item() for prompt, r in zip(prompts, refs) for i in range(1, len(prompt))]
    for a, b in ((got["1"], ref), (got["0"], ref), (got["1"], got["0"])):
        errors = [abs(x - y) for x, y in zip(a, b)]
        assert sum(errors) / len(errors) < 0.01 and max(errors) < 0.06, (sum(errors) / len(errors), max(errors))
