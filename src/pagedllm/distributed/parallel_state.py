"""This process's place in the parallel groups, and the collectives the layers need.

Ranks are numbered pipeline-stage-major, as in vLLM: ``rank = pp_rank * tp_size + tp_rank``.
Each pipeline stage is one tensor-parallel group (all-reduce, all-gather); consecutive
stages exchange activations point to point, rank ``r`` to rank ``r + tp_size``.

With one rank (the default) nothing initialises torch.distributed and the collectives
return their input: a single-device engine never pays for, or depends on, a process group.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_TP_RANK = 0
_TP_SIZE = 1
_PP_RANK = 0
_PP_SIZE = 1
_TP_GROUP = None  # None: the default group (when the whole world is one tensor-parallel group)
_EXPERT_PARALLEL = False  # MoE layers place whole experts on the tensor-parallel ranks
_CUSTOM_AR = None  # custom_all_reduce.CustomAllReduce: small CUDA all-reduces through peer memory


def init_distributed(rank: int, tp_size: int, pp_size: int, init_method: str, backend: str | None = None,
                     enable_expert_parallel: bool = False, custom_all_reduce_device: torch.device | None = None) -> None:
    """Join the world of ``tp_size * pp_size`` ranks and build the tensor-parallel groups;
    ``backend`` None picks nccl on CUDA, gloo on CPU. ``enable_expert_parallel``: MoE layers
    hold whole experts per tensor rank instead of every expert's slice. ``custom_all_reduce_device``:
    this rank's device, to sum small tensor-parallel messages through peer memory where it is a
    GPU (custom_all_reduce; None: NCCL for every all-reduce)."""
    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _EXPERT_PARALLEL, _CUSTOM_AR
    world_size = tp_size * pp_size
    if tp_size < 1 or pp_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {pp_size} pipeline stage(s) x {tp_size} tensor rank(s)")
    group = None
    if world_size > 1:
        import torch.distributed as dist

        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        if pp_size > 1 and tp_size > 1:
            # Every rank takes part in creating every group, in the same order.
            for stage in range(pp_size):
                g = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
                if stage == rank // tp_size:
                    group = g
    _PP_RANK, _TP_RANK = divmod(rank, tp_size)
    _TP_SIZE, _PP_SIZE, _TP_GROUP = tp_size, pp_size, group
    _EXPERT_PARALLEL = bool(enable_expert_parallel)
    if tp_size > 1 and custom_all_reduce_device is not None:
        from pagedllm.distributed.custom_all_reduce import make_custom_all_reduce

        _CUSTOM_AR = make_custom_all_reduce(group, custom_all_reduce_device)


def destroy_distributed() -> None:
    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _EXPERT_PARALLEL, _CUSTOM_AR
    _CUSTOM_AR = None
    if _TP_SIZE * _PP_SIZE > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _EXPERT_PARALLEL = 0, 1, 0, 1, None, False


@contextlib.contextmanager
def replicated() -> Iterator[None]:
    """Within: this rank is its own tensor-parallel world (size 1, collectives off), for a model
    every rank builds and runs whole (a speculative draft with ``draft_tensor_parallel_size=1``)."""
    global _TP_RANK, _TP_SIZE, _EXPERT_PARALLEL
    saved = _TP_RANK, _TP_SIZE, _EXPERT_PARALLEL
    _TP_RANK, _TP_SIZE, _EXPERT_PARALLEL = 0, 1, False
    try:
        yield
    finally:
        _TP_RANK, _TP_SIZE, _EXPERT_PARALLEL = saved


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def expert_parallel_enabled() -> bool:
    """Whether MoE layers split their experts over the tensor-parallel ranks (whole experts each)."""
    return _EXPERT_PARALLEL and _TP_SIZE > 1


def get_pp_rank() -> int:
    return _PP_RANK


def get_pp_size() -> int:
    return _PP_SIZE


def is_first_pp_rank() -> bool:
    return _PP_RANK == 0


def is_last_pp_rank() -> bool:
    return _PP_RANK == _PP_SIZE - 1


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the tensor-parallel ranks (in place where possible); ``x`` itself with one rank."""
    if _TP_SIZE == 1:
        return x
    if _CUSTOM_AR is not None and _CUSTOM_AR.takes(x):
        return _CUSTOM_AR.all_reduce(x)
    import torch.distributed as dist

    x = x.contiguous()
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_max(x: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of ``x`` over the tensor-parallel ranks (in place); ``x`` itself with one rank."""
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The tensor-parallel ranks' ``x`` concatenated along ``dim`` in rank order; ``x`` itself with one rank."""
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x, group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def _stage_rank(stage: int) -> int:
    return stage * _TP_SIZE + _TP_RANK


def pp_send(tensors: list[torch.Tensor]) -> list:
    """Start sending ``tensors`` to the same tensor rank of the next stage; returns the
    handles, which keep the tensors alive until ``wait()``ed."""
    import torch.distributed as dist

    dst = _stage_rank(_PP_RANK + 1)
    return [dist.isend(t.contiguous(), dst) for t in tensors]


def pp_recv(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Receive into ``tensors`` (shapes and dtypes known to both sides) from the previous stage."""
    import torch.distributed as dist

    src = _stage_rank(_PP_RANK - 1)
    for t in tensors:
        dist.recv(t, src)
    return tensors
