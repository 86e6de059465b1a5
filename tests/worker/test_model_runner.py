"""ModelRunner pieces that run at start-up."""
from __future__ import annotations

import torch

from pagedllm.ops.tile_tables import ROW_BUCKETS

from tests.engine.test_correctness import generate_ids, hf_greedy, make_llm, mixed_prompts


def test_kernel_warm_up_writes_nothing_and_changes_nothing(tiny_models):
    """The start-up warm-up step (a mixed decode + chunk batch and a sampler call) leaves the
    KV cache untouched and the engine's outputs exact."""
    llm = make_llm(tiny_models["qwen3"])
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    before = [c.clone() for c in runner.kv_caches]
    rows, compute_logits = [], runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: rows.append(hidden.shape[0]) or compute_logits(hidden)
    try:
        runner.warm_up_kernels()
    finally:
        del runner.model.compute_logits
    # The LM head runs at every row bucket of the small-row GEMMs' tables (each its own kernel variant).
    assert {min(b, runner.max_num_reqs) for b in ROW_BUCKETS} <= set(rows)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))
    prompts = mixed_prompts()[:4]
    assert generate_ids(llm, prompts) == hf_greedy(tiny_models["qwen3"], prompts)
