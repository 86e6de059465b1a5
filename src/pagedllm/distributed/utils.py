"""How a model's layers are split over pipeline stages."""
from __future__ import annotations

from pagedllm import envs

PARTITION_ENV = "PAGEDLLM_PP_LAYER_PARTITION"  # e.g. "10,14": layers per stage, like VLLM_PP_LAYER_PARTITION


def pp_layer_partition(num_layers: int, pp_size: int) -> list[int]:
    """Layers per stage: from ``PAGEDLLM_PP_LAYER_PARTITION`` when set (uneven splits), else
    as even as possible, the first stages taking one more (the last one also runs the LM head)."""
    spec = (envs.PAGEDLLM_PP_LAYER_PARTITION or "").strip()
    if spec:
        try:
            parts = [int(x) for x in spec.split(",")]
        except ValueError:
            raise ValueError(f"{PARTITION_ENV}={spec!r} must be comma-separated layer counts") from None
        if len(parts) != pp_size or sum(parts) != num_layers or min(parts) < 1:
            raise ValueError(f"{PARTITION_ENV}={spec!r} must give {pp_size} positive layer counts (one per pipeline "
                             f"stage) that add up to the model's {num_layers} layers")
        return parts
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} is larger than the model's {num_layers} layers; "
                         "every stage needs at least one")
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if stage < extra else 0) for stage in range(pp_size)]


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers pipeline stage ``pp_rank`` holds."""
    parts = pp_layer_partition(num_layers, pp_size)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]
