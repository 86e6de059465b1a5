"""This process's place in the tensor-parallel group, and the two collectives TP layers need.

With one rank (the default) nothing initialises torch.distributed and the collectives
return their input: a single-device engine never pays for, or depends on, a process group.
"""
from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1


def init_distributed(rank: int, world_size: int, init_method: str, backend: str | None = None) -> None:
    """Join the tensor-parallel group: ``backend`` None picks nccl on CUDA, gloo on CPU."""
    global _TP_RANK, _TP_SIZE
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if world_size > 1:
        import torch.distributed as dist

        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _TP_RANK, _TP_SIZE = rank, world_size


def destroy_distributed() -> None:
    global _TP_RANK, _TP_SIZE
    if _TP_SIZE > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _TP_RANK, _TP_SIZE = 0, 1


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the ranks (in place where possible); ``x`` itself with one rank."""
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order; ``x`` itself with one rank."""
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)
