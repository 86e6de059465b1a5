"""Apply a step's grammar bitmask to the logits: disallowed tokens get -inf (Triton on GPU, torch elsewhere)."""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.ops import triton_ops_for


def expand_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 → [rows, vocab_size] bool, True = allowed (bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()

def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray | torch.Tensor, rows: list[int] | np.ndarray
                        ) -> None:
    """In place: row ``rows[i]`` of ``logits`` keeps only the tokens allowed by ``bitmask[i]``.
    The other rows are not touched (an unconstrained row costs nothing)."""
    if len(rows) == 0:
        return
    bitmask = torch.as_tensor(bitmask).to(logits.device, non_blocking=True)
    rows_t = torch.as_tensor(np.asarray(rows, dtype=np.int64)).to(logits.device, non_blocking=True)
    vocab = logits.shape[-1]
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"the grammar bitmask covers {bitmask.shape[-1] * 32} tokens, the logits {vocab}")
    if triton_ops_for(logits) is not None:
        from pagedllm.structured_output.triton_bitmask import apply_bitmask_triton

        apply_bitmask_triton(logits, bitmask, rows_t)
        return
    allowed = expand_bitmask(bitmask, vocab)
    logits[rows_t] = logits[rows_t].masked_fill(~allowed, float("-inf"))


def apply_grammar(logits: torch.Tensor, grammar, req_ids: list[str]) -> None:
    """Apply a step's ``GrammarBitmask`` to the sampled rows' ``logits`` (row i = ``req_ids[i]``)."""
    index = {r: i for i, r in enumerate(req_ids)}
    picked = [(j, index[r]) for j, r in enumerate(grammar.req_ids) if r in index]
    if not picked:
        return
    mask_rows, logit_rows = zip(*picked)
    bitmask = grammar.bitmask if len(picked) == len(grammar.req_ids) else grammar.bitmask[list(mask_rows)]
    apply_token_bitmask(logits, bitmask, np.asarray(logit_rows, dtype=np.int64))
