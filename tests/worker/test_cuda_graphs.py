"""CUDA graph sizes (decode and piecewise), the padded size a decode step replays, and the start-up
forwards that run on CPU.
(Capture and replay themselves: tests/gpu/test_runner_pieces.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.worker.cuda_graphs import CudaGraphs, cuda_graph_sizes
from pagedllm.worker.device_buffers import DeviceBuffers
from pagedllm.worker.piecewise_graphs import piecewise_sizes
from tests.engine.test_correctness import generate_ids, hf_greedy, make_llm, mixed_prompts


@pytest.mark.parametrize("max_num_reqs, max_num_tokens, sizes", [
    (256, 8192, [1, 2, 4, 8] + list(range(16, 257, 16))),
    (40, 8192, [1, 2, 4, 8, 16, 32, 40]),
    (40, 20, [1, 2, 4, 8, 16, 20]),  # a step never holds more decodes than its token budget
    (8, 100, [1, 2, 4, 8]),
    (5, 100, [1, 2, 4, 5]),
    (1, 100, [1]),
])
def test_graph_sizes_cover_every_batch_up_to_the_limit(max_num_reqs, max_num_tokens, sizes):
    assert cuda_graph_sizes(max_num_reqs, max_num_tokens) == sizes


def test_piecewise_sizes_pad_any_step_by_under_32_tokens_or_a_quarter():
    sizes = piecewise_sizes(2048)
    assert sizes[:9] == [32, 64, 96, 128, 160, 192, 224, 256, 320] and sizes[-1] == 2048 and len(sizes) == 20
    for n in range(1, 2049):
        padded = next(s for s in sizes if s >= n)
        assert padded - n < 32 or padded < n * 1.25, n
    assert piecewise_sizes(100) == [32, 64, 96, 100]  # the step budget itself is the largest
    assert piecewise_sizes(0) == []


def cpu_graphs(graph_safe: bool = True) -> CudaGraphs:
    buffers = DeviceBuffers(64, 40, 4, torch.device("cpu"))
    return CudaGraphs(buffers, torch.device("cpu"), graph_safe, 1, 40, 64, 128)


def test_a_decode_step_replays_the_smallest_captured_size_that_holds_it():
    graphs = cpu_graphs()
    assert graphs.size_for(1) is None  # nothing captured yet: eager
    graphs.sizes = graphs.candidate_sizes  # as capture leaves them
    got = [graphs.size_for(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 32, 33, 40, 41)]
    assert got == [1, 2, 4, 8, 8, 16, 16, 32, 32, 40, 40, None]
    graphs.release()
    assert graphs.size_for(1) is None and graphs.graphs == {}


def test_capture_is_a_no_op_off_cuda():
    graphs = cpu_graphs()
    graphs.capture(torch.nn.Identity())
    assert graphs.graphs == {} and graphs.sizes == []


@pytest.fixture(scope="module")
def llm(tiny_models):
    return make_llm(tiny_models["qwen3"])


def test_compile_dry_run_leaves_the_kv_cache_and_outputs_alone(llm, tiny_models):
    """The dry run (the profiling forward, the warm-up step) reads and writes only a scratch
    cache: the engine's cache and its outputs stay as they were."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    prompts = mixed_prompts()[:3]
    first = generate_ids(llm, prompts)
    before = [c.clone() for c in runner.kv_caches]
    runner.compile_dry_run()
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))
    assert all(layer.kv_cache is cache for layer, cache in zip(runner.attn_layers, runner.kv_caches))
    assert generate_ids(llm, prompts) == first == hf_greedy(tiny_models["qwen3"], prompts)


def test_steps_with_prefill_chunks_stay_eager_on_cpu(llm):
    """Piecewise graphs are CUDA's (tests/gpu/test_piecewise_graphs.py): the CPU runner keeps none."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    if runner.device.type != "cpu":
        pytest.skip("the module's engine runs on the GPU here")
    assert runner.graphs.piecewise is None and runner.graphs.piece_size(40, eager=False) is None


def test_device_buffers_on_cpu_pad_in_place_and_read_sampled_tokens_directly():
    buf = DeviceBuffers(16, 4, 3, torch.device("cpu"))
    ids = buf.upload("input_ids", np.array([5, 6, 7]), 5, pad=0)
    slots = buf.upload("slot_mapping", np.array([3, 4]), 4, pad=-1)
    assert ids.dtype == torch.int64 and ids.tolist() == [5, 6, 7, 0, 0]
    assert slots.tolist() == [3, 4, -1, -1]
    assert buf.upload("seq_lens", np.array([2, 9])).dtype == torch.int32
    assert buf.upload_block_tables(np.arange(6, dtype=np.int32).reshape(2, 3)).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert buf.sampled_tokens_host(3) is None
