"""Process groups and tensor-parallel collectives (see parallel_state)."""
from pagedllm.distributed.parallel_state import (
    destroy_distributed, get_tp_rank, get_tp_size, init_distributed, tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "destroy_distributed", "get_tp_rank", "get_tp_size", "init_distributed",
    "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce",
]
