"""Verification of proposed tokens: exact greedy, and rejection sampling that keeps the
target distribution.

A request that proposed k tokens has k + 1 logits rows this step: row j scores the token
after draft j - 1 (row 0: after its last known token). Row j accepts draft j when the
target picks it: for a greedy row, when it is the argmax; for a random row, with
probability p_j(draft_j), where p_j is the row's distribution after temperature, min-p,
top-k and top-p (the proposal is a point mass q = 1 on the draft, so the standard rule
min(1, p/q) is p). At the first rejected row the token comes from the residual
max(p_j - q_j, 0), normalised: p_j without the draft. When every draft is accepted, the
last row samples a bonus token from p_k. The emitted tokens are then distributed exactly as
target samples one token at a time.
"""
from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.sample.draw import draw, greedy
from pagedllm.sample.sampler import _EPS, Sampler, SamplingMetadata


def verify(logits: torch.Tensor, md: SamplingMetadata, draft_ids: torch.Tensor,
           num_drafts: list[int]) -> list[list[int]]:
    """``logits`` [sum(k_i + 1), V] for requests with ``num_drafts`` k_i; ``draft_ids`` the
    same length, -1 at each request's last row (no draft to check there). ``md`` has one row
    per logits row. Returns each request's emitted tokens: its accepted drafts and one more."""
    logits = Sampler._apply_row_edits(logits.to(torch.float32), md)
    has_draft = draft_ids >= 0
    drafts = draft_ids.clamp(min=0)
    target = greedy(logits)
    greedy_rows = md.temperature < _EPS
    if md.all_greedy:
        accept, emitted = (drafts == target) & has_draft, target
    else:
        probs = Sampler.probs(logits, md)
        p_draft = probs.gather(1, drafts[:, None]).squeeze(1)
        u = torch.rand(p_draft.shape, device=p_draft.device)
        accept = torch.where(greedy_rows, drafts == target, u < p_draft) & has_draft
        # The residual: p without the draft (rows with no draft keep p: the bonus token).
        probs[has_draft.nonzero().squeeze(1), drafts[has_draft]] = 0.0
        emitted = torch.where(greedy_rows, target, draw(probs, {}))
    if envs.PAGEDLLM_SPEC_FORCE_ACCEPT:  # benchmarks only: the ceiling of the machinery
        accept = has_draft
    # One device-to-host copy (and wait) for the three.
    accept_l, emitted_l, drafts_l = torch.stack((accept.to(torch.int64), emitted, draft_ids)).tolist()
    out, row = [], 0
    for k in num_drafts:
        tokens = []
        for j in range(row, row + k + 1):
            if j < row + k and accept_l[j]:
                tokens.append(drafts_l[j])
                continue
            tokens.append(emitted_l[j])
            break
        out.append(tokens)
        row += k + 1
    return out
