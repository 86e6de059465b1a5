"""The model runner's side of pooling models: each running request's PoolingParams, BERT token
types for the step, and the pooled outputs of the prompts that end in it."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.model.pooler import Pooler


class PoolingSteps:
    def __init__(self, model: nn.Module, model_config: ModelConfig, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.pooler = Pooler(model.pooling_kind, model_config.pooler_config)
        self.is_encoder = model_config.is_encoder
        self.params: dict[str, object] = {}  # req_id -> PoolingParams

    def track(self, sched: SchedulerOutput) -> None:
        """Finished and preempted requests are forgotten (a preempted one comes back new)."""
        gone = sched.finished_req_ids | sched.preempted_req_ids
        self.pooler.forget(gone)
        for r in gone:
            self.params.pop(r, None)
        for new in sched.scheduled_new_reqs:
            if new.pooling_params is None:
                raise ValueError(f"request {new.req_id} asks to generate from a pooling model")
            self.params[new.req_id] = new.pooling_params

    def token_types(self, states: list, query_start_loc: list[int], num_tokens: int) -> torch.Tensor | None:
        """BERT token types of the step's tokens (encoders run whole prompts), or None when no
        prompt has any (all type 0)."""
        types = [self.params[s.req_id].extra_kwargs.get("token_type_ids") for s in states]
        if not any(types):
            return None
        flat = np.zeros(num_tokens, dtype=np.int64)
        for i, t in enumerate(types):
            if t:
                flat[query_start_loc[i]:query_start_loc[i + 1]] = t
        return torch.from_numpy(flat).to(self.device, non_blocking=True)

    def pool(self, states: list, query_start_loc: list[int], starts: list[int], ended: set[int],
             hidden: torch.Tensor) -> dict[str, np.ndarray]:
        """Feed each request's rows to the pooler; the requests whose prompt ended (rows
        ``ended``) get their result. Requests asking alike (task, activation, dimensions) go
        through the head together, and come back to the host in one copy."""
        qsl = query_start_loc
        groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
        for i, s in enumerate(states):
            lo, hi, start = qsl[i], qsl[i + 1], starts[i]
            pooled = self.pooler.add_chunk(s.req_id, hidden[lo:hi], s.token_ids[start:start + hi - lo], start,
                                           i in ended)
            if pooled is not None:
                p = self.params[s.req_id]
                key = (p.task, p.use_activation, p.dimensions, pooled.dim() == 1)
                groups.setdefault(key, []).append((s.req_id, pooled))
        out: dict[str, np.ndarray] = {}
        for (task, activation, dims, stackable), items in groups.items():
            if stackable:
                data = self.pooler.head(self.model, torch.stack([t for _, t in items]), task, activation, dims)
                rows = data.cpu().numpy()
                out.update((r, rows[j]) for j, (r, _) in enumerate(items))
            else:
                for r, t in items:
                    out[r] = self.pooler.head(self.model, t, task, activation, dims).cpu().numpy()
        return out
