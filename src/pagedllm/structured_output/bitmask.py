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
    vocab = logits.shape[-1]
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"the grammar bitmask covers {bitmask.shape[-1] * 32} tokens, the logits {vocab}")
    rows_np = np.asarray(rows, dtype=np.int64)
    if triton_ops_for(logits) is not None:
        from pagedllm.structured_output.triton_bitmask import apply_bitmask_triton

        apply_bitmask_triton(logits, torch.as_tensor(bitmask).to(logits.device, non_blocking=True),
                             torch.from_numpy(rows_np).to(logits.device, non_blocking=True))
        return
    # numpy unpacks the bits a byte at a time (8x less work than shifting int32 words).
    host = bitmask.cpu().numpy() if isinstance(bitmask, torch.Tensor) else np.ascontiguousarray(bitmask)
    bits = np.unpackbits(host.view(np.uint8), axis=1, count=vocab, bitorder="little")
    disallowed = torch.from_numpy(bits).view(torch.bool).logical_not_().to(logits.device)
    if len(rows_np) == logits.shape[0] and (rows_np == np.arange(len(rows_np))).all():
        logits.masked_fill_(disallowed, float("-inf"))  # every row, in order: in place
    else:
        rows_t = torch.from_numpy(rows_np).to(logits.device)
        logits[rows_t] = logits[rows_t].masked_fill_(disallowed, float("-inf"))


def apply_grammar(logits: torch.Tensor, grammar, req_ids: list[str]) -> None:
    """Apply a step's ``GrammarBitmask`` to the sampled rows' ``logits`` (row i = ``req_ids[i]``)."""
    index = {r: i for i, r in enumerate(req_ids)}
    picked = [(j, index[r]) for j, r in enumerate(grammar.req_ids) if r in index]
    if not picked:
        return
    mask_rows, logit_rows = zip(*picked)
    bitmask = grammar.bitmask if len(picked) == len(grammar.req_ids) else grammar.bitmask[list(mask_rows)]
    apply_token_bitmask(logits, bitmask, np.asarray(logit_rows, dtype=np.int64))
