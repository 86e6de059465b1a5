"""A step that verifies proposed tokens (speculative decoding), on the runner's side.

A request with k drafts has k + 1 logits rows (``ModelRunner._prepare_inputs`` gathers them);
the others have one. Requests without drafts sample as in any step, with the sampler (their
logprobs, penalties and seeds included); those with drafts go through
``sample.rejection.verify``, and their emitted tokens (1 to k + 1) land with the step's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.sample.rejection import verify
from pagedllm.sample.sampler import SamplingMetadata
from pagedllm.structured_output.bitmask import apply_grammar

if TYPE_CHECKING:
    from pagedllm.worker.input_batch import CachedRequestState
    from pagedllm.worker.model_runner import ModelRunner, _Batch
    from pagedllm.worker.pending_output import PendingOutput


def verify_drafts(runner: "ModelRunner", sched: SchedulerOutput, states: list["CachedRequestState"],
                  batch: "_Batch", logits: torch.Tensor, pending: "PendingOutput"
                  ) -> tuple[list["CachedRequestState"], torch.Tensor, SamplingMetadata | None]:
    """Verify the drafted requests (their tokens go to ``pending.spec``); returns the requests
    that sample one token as usual, their logits rows and their sampling metadata."""
    num_drafts = batch.num_drafts
    sampling = [states[i] for i in batch.sample_rows]
    expanded = [s.req_id for s, k in zip(sampling, num_drafts) for _ in range(k + 1)]
    if sched.grammar is not None:  # constrained requests never draft: one row each
        apply_grammar(logits, sched.grammar, expanded)
    first = np.concatenate([[0], np.cumsum(np.asarray(num_drafts) + 1)[:-1]])
    plain = [i for i, k in enumerate(num_drafts) if k == 0]
    drafted = [i for i, k in enumerate(num_drafts) if k > 0]
    ib, builder = runner.input_batch, runner.sampling_metadata

    rows = [j for i in drafted for j in range(first[i], first[i] + num_drafts[i] + 1)]
    spec_states = [sampling[i] for i in drafted for _ in range(num_drafts[i] + 1)]
    draft_ids = [t for i in drafted for t in sched.scheduled_spec_decode_tokens[sampling[i].req_id] + [-1]]
    index = _on_device(rows, logits.device)
    md = builder.build(spec_states, ib.rows_of(spec_states), batch.temperature[index])
    tokens = verify(logits[index], md, _on_device(draft_ids, logits.device), [num_drafts[i] for i in drafted])
    pending.spec = [(batch.sample_rows[i], sampling[i], t) for i, t in zip(drafted, tokens)]

    pending.sample_rows = [batch.sample_rows[i] for i in plain]
    plain_states = [sampling[i] for i in plain]
    if not plain_states:
        return [], logits[:0], None
    index = _on_device([int(first[i]) for i in plain], logits.device)
    md = builder.build(plain_states, ib.rows_of(plain_states), batch.temperature[index])
    return plain_states, logits[index], md


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small int64 list on the device without waiting for the step in flight (a copy from
    pageable memory would first wait for the stream: the target's whole forward)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
