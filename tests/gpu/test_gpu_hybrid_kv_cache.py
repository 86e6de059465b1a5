"""GPU-only: per-layer-group KV cache (Gemma 2 1:1, Gemma 3 5:1) through the Triton kernels, the
CUDA graphs' per-group buffers and async scheduling: greedy tokens equal transformers' (fp32),
eagerly with chunked prefill and prefix hits too, and every block is back in the pool after."""
from __future__ import annotations

import pytest
import torch

from tests.engine.test_correctness import hf_greedy, mixed_prompts, shared_prefix_prompts
from tests.engine.test_hybrid_kv_cache import gemmas  # noqa: F401  (the module's fixture)
from tests.gpu.test_gpu_engine import _greedy, _ids, _llm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_hybrid_groups_match_transformers_with_graphs_and_eagerly(gemmas, arch, monkeypatch):  # noqa: F811
    prompts = mixed_prompts() + shared_prefix_prompts()
    ref = hf_greedy(gemmas[arch], prompts, max_new_tokens=24)
    fast = _llm(gemmas[arch], monkeypatch, block_size=8)
    runner = fast.llm_engine.engine_core.executor.worker.model_runner
    assert runner.cuda_graphs and len(runner.kv_groups) > 1
    assert _ids(_greedy(fast, prompts, max_tokens=24)) == ref
    kv = fast.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    del fast
    eager = _llm(gemmas[arch], monkeypatch, enforce_eager=True, max_num_batched_tokens=32, block_size=8)
    assert _ids(_greedy(eager, prompts, max_tokens=24)) == ref
    assert _ids(_greedy(eager, prompts, max_tokens=24)) == ref  # from prefix hits
    assert eager.llm_engine.engine_core.kv_cache_manager.stats.hits > 0
