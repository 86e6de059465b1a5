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

        mask_d, rows_d = _staging(logits.device).upload(np.asarray(bitmask, dtype=np.int32), rows_np)
        apply_bitmask_triton(logits, mask_d, rows_d)
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


class _PinnedStaging:
    """The masks (and their rows) go to the device through pinned host buffers, two used in
    turn: a copy from pageable memory may wait for the device's queue (the forward in flight),
    a pinned one does not. A buffer is rewritten only once its last copy has run. Layout of
    one upload: the R logit rows, then the [R, words] masks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host: list[torch.Tensor | None] = [None, None]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        self.used = [False, False]
        self.dev: torch.Tensor | None = None
        self.turn, self.shape = 0, (0, 0)

    def host_view(self, r: int, words: int) -> np.ndarray:
        """The next buffer's [r, words] mask region, free to write."""
        n = r + r * words
        self.turn ^= 1
        t = self.turn
        if self.used[t]:
            self.copied[t].synchronize()
        if self.host[t] is None or self.host[t].numel() < n:
            old = 0 if self.host[t] is None else self.host[t].numel()
            self.host[t] = torch.empty(max(n, 2 * old), dtype=torch.int32, pin_memory=True)
        self.shape = (r, words)
        return self.host[t].numpy()[r:n].reshape(r, words)

    def send(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the buffer ``host_view`` gave (its masks written) and ``rows`` to the device."""
        (r, words), t = self.shape, self.turn
        n = r + r * words
        self.host[t].numpy()[:r] = rows
        if self.dev is None or self.dev.numel() < n:
            self.dev = torch.empty(self.host[t].numel(), dtype=torch.int32, device=self.device)
        dev = self.dev[:n]
        dev.copy_(self.host[t][:n], non_blocking=True)
        self.copied[t].record()
        self.used[t] = True
        return dev[r:].view(r, words), dev[:r]

    def upload(self, bitmask: np.ndarray, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        self.host_view(*bitmask.shape)[:] = bitmask
        return self.send(rows)


_STAGINGS: dict[torch.device, _PinnedStaging] = {}


def _staging(device: torch.device) -> _PinnedStaging:
    staging = _STAGINGS.get(device)
    if staging is None:
        staging = _STAGINGS[device] = _PinnedStaging(device)
    return staging


def apply_grammar(logits: torch.Tensor, grammar, req_ids: list[str]) -> None:
    """Apply a step's ``GrammarBitmask`` to the sampled rows' ``logits`` (row i = ``req_ids[i]``)."""
    index = {r: i for i, r in enumerate(req_ids)}
    picked = [(j, index[r]) for j, r in enumerate(grammar.req_ids) if r in index]
    if not picked:
        return
    mask_rows, logit_rows = zip(*picked)
    rows = np.asarray(logit_rows, dtype=np.int64)
    if len(picked) == len(grammar.req_ids) and triton_ops_for(logits) is not None:
        # The masks are filled straight into the pinned buffer that goes to the device.
        from pagedllm.structured_output.triton_bitmask import apply_bitmask_triton

        stage = _staging(logits.device)
        grammar.fill_into(stage.host_view(len(rows), grammar.words))
        apply_bitmask_triton(logits, *stage.send(rows))
        return
    bitmask = grammar.bitmask if len(picked) == len(grammar.req_ids) else grammar.bitmask[list(mask_rows)]
    apply_token_bitmask(logits, bitmask, rows)
