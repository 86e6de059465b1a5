"""Process groups and tensor-/pipeline-parallel collectives (see parallel_state)."""
from pagedllm.distributed.parallel_state import (
    destroy_distributed, expert_parallel_enabled, get_pp_rank, get_pp_size, get_tp_rank, get_tp_size,
    init_distributed, is_first_pp_rank, is_last_pp_rank, pp_recv, pp_send, tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "destroy_distributed", "expert_parallel_enabled", "get_pp_rank", "get_pp_size", "get_tp_rank", "get_tp_size",
    "init_distributed", "is_first_pp_rank", "is_last_pp_rank", "pp_recv", "pp_send",
    "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce",
]
