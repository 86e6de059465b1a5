"""GPU-only: the runner's device pieces directly: pinned uploads, the sampled-token double
buffer, and a captured decode graph replaying what the eager forward computes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM
from pagedllm.worker.device_buffers import DeviceBuffers
from tests.engine.test_correctness import generate_ids, mixed_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_uploads_match_the_cpu_path_and_sampled_buffers_alternate():
    gpu = DeviceBuffers(16, 4, 3, torch.device("cuda"))
    cpu = DeviceBuffers(16, 4, 3, torch.device("cpu"))
    gpu.begin_step()
    for name, values, size, pad in (("input_ids", [5, 6, 7], 5, 0), ("slot_mapping", [3, 4], 4, -1),
                                    ("seq_lens", [2, 9], None, 0), ("temperature", [0.5], None, 0)):
        got = gpu.upload(name, np.array(values), size, pad=pad)
        want = cpu.upload(name, np.array(values), size, pad=pad)
        assert got.device.type == "cuda" and got.dtype == want.dtype and torch.equal(got.cpu(), want)
    table = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert gpu.upload_block_tables(table).cpu().tolist() == table.tolist()
    gpu.end_step()
    first, second, third = (gpu.sampled_tokens_host(3) for _ in range(3))
    assert first.is_pinned() and first.shape == (3,)
    assert first.data_ptr() != second.data_ptr() and third.data_ptr() == first.data_ptr()


def test_captured_graphs_replay_the_eager_forward(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", seed=0, device="cuda", kv_cache_memory_bytes=256 * 2**20)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    graphs = runner.graphs
    assert graphs.sizes == graphs.candidate_sizes and set(runner.cuda_graphs) == set(graphs.sizes)
    generate_ids(llm, mixed_prompts(4))  # the cache holds something to attend to
    buf = graphs.reset_inputs()
    for bs in (1, 4, graphs.sizes[-1]):
        buf.input_ids[:bs].copy_(torch.arange(3, 3 + bs))
        with torch.inference_mode():
            eager = runner.model(buf.input_ids[:bs], buf.positions[:bs], graphs.metadata(bs)).clone()
            replayed = graphs.replay(bs, bs).clone()
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    runner.release_cuda_graphs()
    assert runner.cuda_graphs == {} and graphs.size_for(1) is None
    torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # freed at once: the allocator keeps it cached
    reserved = torch.cuda.memory_reserved()
    runner.capture_cuda_graphs()
    assert graphs.sizes == graphs.candidate_sizes
    # Capture leaves the allocator's cached blocks alone (torch.cuda.graph() empties them before each graph).
    assert torch.cuda.memory_reserved() >= reserved
