"""Tensor-parallel all-reduce: NCCL against the peer-memory kernels (distributed/custom_all_reduce).

One process per GPU (``--world-size``, default every visible GPU). For each message size (bf16
elements; the decode activations of a model are rows x hidden size x 2 bytes) every path is
first checked against NCCL's sum (the same bits on every rank), then timed as the engine runs
it in a decode step: ``--iters`` all-reduces captured back to back in one CUDA graph, the
graph replayed ``--repeats`` times, µs per all-reduce as the median over replays (CUDA events),
rank 0's figure. ``eager`` rows time the same calls launched from Python (prefill steps).

    python -m pagedllm.benchmarks.all_reduce --sizes-kib 8,64,256,512,1024,2048,4096,8192

JSON lines (``benchmark: all_reduce``), then a table: us per path and size.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from pagedllm.benchmarks.common import emit, int_list, print_table

PATHS = ("nccl", "one_shot", "two_shot", "triton", "lamport")


def _reduce(path: str, comm, x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if path == "nccl":
        dist.all_reduce(x)
        return x
    comm.one_shot_max_bytes = comm.max_bytes if path == "one_shot" else 0
    comm.lamport_max_bytes = 0  # the Lamport kernel only where asked for (called directly below)
    comm.triton_min_bytes = 0 if path == "triton" else comm.max_bytes + 1
    if path in ("triton", "lamport"):  # the engine takes them in graphs only; timed eagerly all the same
        out = torch.empty_like(x)
        (comm._triton_one_shot if path == "triton" else comm._lamport)(x.view(-1), out.view(-1))
        return out
    return comm.all_reduce(x)


def _time(fn, iters: int, repeats: int, graph: bool) -> float:
    """Median µs per call of ``fn`` (iters calls per timed unit). Fixed counts, not the shared
    timers (triton's ``do_bench_cudagraph`` picks its counts per process): every rank must launch
    the same collectives."""
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        unit = g.replay
    else:
        def unit():
            for _ in range(iters):
                fn()
    for _ in range(3):
        unit()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        unit()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    import torch.distributed as dist

    from pagedllm.distributed.custom_all_reduce import CustomAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    comm = CustomAllReduce(dist.group.WORLD.group_name, device, max_bytes=max(args.sizes_kib) << 10,
                           lamport_max_bytes=max(args.sizes_kib) << 10)
    rows = []
    for kib in args.sizes_kib:
        n = (kib << 10) // 2
        gen = torch.Generator(device=device).manual_seed(rank * 1000 + kib)
        x = torch.randn(n, device=device, dtype=torch.bfloat16, generator=gen)
        ref = x.clone()
        dist.all_reduce(ref)
        row = {"size_kib": kib}
        for path in PATHS:
            if path == "lamport" and not comm.lamport_slot:  # two ranks only
                continue
            got = _reduce(path, comm, x.clone())
            # Bit-identical to NCCL's sum, and the same bits on every rank.
            gathered = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(gathered, got)
            row[f"{path}_exact"] = bool(torch.equal(got, ref)) and all(torch.equal(g, got) for g in gathered)
            buf = x.clone()
            for mode in ("graph", "eager"):
                row[f"{path}_{mode}_us"] = round(_time(lambda: _reduce(path, comm, buf), args.iters, args.repeats,
                                                       mode == "graph"), 2)
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=0, help="GPUs (default: every visible one)")
    p.add_argument("--sizes-kib", type=int_list, default=[8, 32, 128, 256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--port", type=int, default=29533)
    args = p.parse_args()
    world = args.world_size or torch.cuda.device_count()
    if world < 2:
        raise SystemExit("needs at least two GPUs")
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, args.port, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    rows = queue.get()
    for proc in procs:
        proc.join()
    for row in rows:
        emit({"benchmark": "all_reduce", "world_size": world, "dtype": "bfloat16", **row})
    print_table(rows, ["size_kib"] + [f"{p}_{m}_us" for m in ("graph", "eager") for p in PATHS]
                + [f"{p}_exact" for p in PATHS[1:]])


if __name__ == "__main__":
    main()
