"""GPU-only (two GPUs): the peer-memory all-reduce (distributed/custom_all_reduce) gives NCCL's
sums bit for bit (up to the sign of a zero sum in the Lamport kernel), eagerly, back to back across
its kernels and replayed in a CUDA graph, for every size up to its buffer; larger and fp16 messages
fall back to NCCL; the Lamport kernel takes -0.0 inputs and leaves its buffer marked for the next
calls; a TP=2 engine with it gives the same tokens as with NCCL, and samples the same tokens from
its ranks' vocabulary slices as from the gathered logits."""
from __future__ import annotations

import socket

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_correctness import generate_ids, mixed_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two GPUs")

# elements: tiny (one 16-byte vector), decode rows of 4096 bf16 (1, 32 and 64 rows: one- and
# two-shot), an odd row count, the buffer's whole size and one past it (NCCL).
SHAPES = [(8,), (1, 4096), (32, 4096), (64, 4096), (37, 4096), (1024, 4096), (1025, 4096)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, errors) -> None:
    try:
        _check_rank(rank, port)
    except BaseException as e:  # noqa: BLE001 - reported to the test process
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def _check_rank(rank: int, port: int) -> None:
    import torch.distributed as dist

    from pagedllm.distributed import parallel_state as ps

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    ps.init_distributed(rank, 2, 1, f"tcp://127.0.0.1:{port}", custom_all_reduce_device=device)
    comm = ps._CUSTOM_AR
    assert comm is not None, "the custom all-reduce did not start on two GPUs with peer access"
    comm_bytes = comm.max_bytes
    for d, dtype in enumerate((torch.bfloat16, torch.float32, torch.float16)):
        for s, shape in enumerate(SHAPES):
            gen = torch.Generator(device=device).manual_seed(1000 * rank + 100 * d + s)
            x = torch.randn(shape, device=device, generator=gen).to(dtype)
            want = x.clone()
            dist.all_reduce(want)
            expect_custom = dtype != torch.float16 and x.numel() * x.element_size() <= comm_bytes
            assert comm.takes(x) == expect_custom, (shape, dtype)
            got = ps.tensor_model_parallel_all_reduce(x.clone())
            assert got.shape == x.shape and torch.equal(got, want), (shape, dtype)
    # Back to back in a graph, sizes alternating between the kernels (torch's one-shot / two-shot, the Triton
    # one-shot from TRITON_MIN_BYTES): every sum exact; after, the Triton kernel's flags hold the last call's
    # number at most (every slot a call used), and no program of a call is left counted.
    xs = [torch.randn(rows, 4096, device=device, generator=gen).to(dtype)
          for rows, dtype in ((64, torch.bfloat16), (1, torch.bfloat16), (256, torch.bfloat16), (31, torch.bfloat16),
                              (512, torch.bfloat16), (128, torch.float32), (128, torch.bfloat16))]
    wants = [x.clone() for x in xs]
    for x, w in zip(xs, wants):
        dist.all_reduce(w)
        out = torch.empty_like(x)
        comm._triton_one_shot(x.view(-1), out.view(-1))  # launched eagerly too (the benchmark's eager row)
        assert torch.equal(out, w)
    sizes = [x.numel() * x.element_size() for x in xs]
    assert min(sizes) < comm.triton_min_bytes <= max(sizes)
    outs = [torch.empty_like(x) for x in xs]
    graph = torch.cuda.CUDAGraph()  # the Triton kernel runs in graphs only (as in decode steps)
    with torch.cuda.graph(graph):
        for _ in range(3):
            for x, o in zip(xs, outs):
                o.copy_(ps.tensor_model_parallel_all_reduce(x))
    for _ in range(7):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(outs, wants))
    calls = comm._state[0].item()
    assert calls > 0 and comm._state[1].item() == 0
    assert comm.buffer[2 * comm.max_bytes:].view(torch.int32).max().item() == calls
    # Replayed in a CUDA graph (as decode steps run) with new inputs each replay.
    static = torch.empty(32, 4096, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ps.tensor_model_parallel_all_reduce(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ps.tensor_model_parallel_all_reduce(static * 2)
    for step in range(3):
        static.copy_(torch.full_like(static, float(rank + step)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(out, 2.0 * (0 + step) + 2.0 * (1 + step))), step
    _check_lamport(comm, device)
    dist.barrier()
    ps.destroy_distributed()


def _check_lamport(comm, device) -> None:
    """The Lamport kernel (bf16 up to ``lamport_max_bytes`` in graphs) over inputs of -0.0, its "not arrived"
    mark: sums of +0.0 (a kernel that sent -0.0 as it is would wait forever). After it, only the last call's
    region holds data: every other element of the buffer is the mark again, and no program is left counted."""
    from pagedllm.distributed.triton_all_reduce import NEG_ZERO_BITS

    assert comm.lamport_max_bytes >= 32 * 4096 * 2
    x = torch.full((32, 4096), -0.0, device=device, dtype=torch.bfloat16)
    x[0, :7] = torch.arange(7, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ps_all_reduce(x)
    for _ in range(4):
        graph.replay()
    torch.cuda.synchronize()
    want = torch.zeros_like(x)
    want[0, :7] = 2 * torch.arange(7, device=device)
    assert torch.equal(out, want) and not torch.signbit(out).any()
    state = comm._lamport_state.tolist()
    assert state[1] == 0 and state[2 + (state[0] - 1) % 3] == x.numel()
    regions = comm.lamport_buffer.view(torch.int16).view(3, comm.world_size, -1)
    last = (state[0] - 1) % 3
    for region in range(3):
        for slot in range(comm.world_size):
            data = regions[region, slot]
            if region == last and slot != comm.rank:  # the peer's last message, -0.0 made +0.0
                assert not (data[:x.numel()] == NEG_ZERO_BITS).any() and (data[x.numel():] == NEG_ZERO_BITS).all()
            else:
                assert (data == NEG_ZERO_BITS).all(), (region, slot)


def ps_all_reduce(x: torch.Tensor) -> torch.Tensor:
    from pagedllm.distributed import parallel_state as ps

    return ps.tensor_model_parallel_all_reduce(x)


def test_custom_all_reduce_equals_nccl_eager_and_in_graphs():
    ctx = torch.multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    messages = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert all(p.exitcode == 0 for p in procs), messages


def _custom_all_reduce_on(worker) -> bool:
    from pagedllm.distributed import parallel_state

    return parallel_state._CUSTOM_AR is not None


def test_tp2_tokens_equal_with_and_without_the_custom_all_reduce(tiny_models):
    prompts = mixed_prompts(4)
    outs = {}
    for disable in (False, True):
        llm = LLM(tiny_models["llama"], dtype="bfloat16", seed=0, tensor_parallel_size=2, gpu_memory_utilization=0.3,
                  disable_custom_all_reduce=disable)
        try:
            assert llm.collective_rpc(_custom_all_reduce_on) == [not disable] * 2
            outs[disable] = generate_ids(llm, prompts)
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert outs[False] == outs[True]


def test_tp2_sampled_tokens_equal_with_and_without_sampling_from_vocabulary_slices(tiny_models, monkeypatch):
    """sample/sharded.py on two GPUs: temperature-only batches sampled from each rank's vocabulary slice give
    the tokens of the gathered logits (the same noise at every id), step after step."""
    prompts = mixed_prompts(4)
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_SHARDED_SAMPLING", flag)  # read by the spawned workers
        llm = LLM(tiny_models["llama"], dtype="bfloat16", seed=0, tensor_parallel_size=2, gpu_memory_utilization=0.3)
        try:
            outs[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert outs["1"] == outs["0"] and len({tuple(t) for t in outs["1"]}) > 1
