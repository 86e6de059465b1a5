"""Prompt logprobs: the log-probabilities of prompt tokens 1.. as the prefill computes them."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.core.messages import PositionLogprobs
from pagedllm.sample.sampler import compute_logprobs_with_ranks


def prompt_logprobs(model: nn.Module, states: list, starts: list[int], query_start_loc: list[int],
                    hidden: torch.Tensor) -> dict[str, list[PositionLogprobs]]:
    """Logprobs of prompt tokens 1.. for the positions this step computed (chunk by chunk):
    request ``i`` ran rows ``query_start_loc[i]..`` from position ``starts[i]``."""
    result: dict[str, list[PositionLogprobs]] = {}
    for i, state in enumerate(states):
        k = state.sampling_params.prompt_logprobs
        start = starts[i]
        end = min(start + (query_start_loc[i + 1] - query_start_loc[i]), state.num_prompt_tokens - 1)
        if k is None or start >= end:
            continue
        lo = query_start_loc[i]
        logits = model.compute_logits(hidden[lo:lo + end - start])
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(state.token_ids[start + 1:end + 1], device=hidden.device)
        num_top = logprobs.shape[-1] if k < 0 else k
        ids, lps, ranks = compute_logprobs_with_ranks(logprobs, targets, num_top)
        result[state.req_id] = list(zip(ids.tolist(), lps.tolist(), ranks.tolist()))
    return result
