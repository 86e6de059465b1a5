"""One launched step's output: its sampled tokens may still be on their way to the host
(async scheduling); ``result()`` waits for them once and hands them to the runner's rows."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.core.messages import PositionLogprobs
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.worker.routed_experts import split_routed

if TYPE_CHECKING:
    from pagedllm.worker.input_batch import CachedRequestState
    from pagedllm.worker.model_runner import ModelRunner


class PendingOutput:
    """One step's ModelRunnerOutput, its sampled tokens possibly still being copied to the host."""

    def __init__(self, runner: ModelRunner | None, req_ids: list[str], sample_rows: list[int]) -> None:
        self.runner, self.req_ids, self.sample_rows = runner, req_ids, sample_rows
        self.states: list[CachedRequestState] = []
        self.sampler_output = None
        self.host_tokens: torch.Tensor | None = None
        self.event = None
        self.prompt_logprobs: dict[str, list[PositionLogprobs]] = {}
        # Speculative decoding: (row in req_ids, state, emitted tokens) of the drafted requests.
        self.spec: list[tuple[int, CachedRequestState, list[int]]] = []
        self.routed = None  # (spans, device rows) of enable_return_routed_experts
        self._result: ModelRunnerOutput | None = None

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> "PendingOutput":
        pending = cls(None, output.req_ids, [])
        pending._result = output
        return pending

    def launch_copy(self, states: list[CachedRequestState], out, host: torch.Tensor | None) -> None:
        """Start copying ``out``'s sampled tokens into the pinned ``host`` buffer (None: read
        them where they are, on CPU)."""
        self.states, self.sampler_output = states, out
        if host is None:
            self.host_tokens = out.sampled_token_ids
            return
        self.host_tokens = host
        host.copy_(out.sampled_token_ids, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting for the device."""
        return self._result is not None or self.event is None or self.event.query()

    def result(self) -> ModelRunnerOutput:
        """Wait for the tokens, hand them to the runner's request rows (once)."""
        if self._result is not None:
            return self._result
        sampled_lists: list[list[int]] = [[] for _ in self.req_ids]
        logprobs: dict[str, PositionLogprobs] = {}
        tokens: list[int] = []
        if self.states:
            if self.event is not None:
                self.event.synchronize()
            tokens = self.host_tokens.tolist()
            out = self.sampler_output
            if out.logprobs is not None:
                lp_ids, lps, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist()
            for j, (row, state) in enumerate(zip(self.sample_rows, self.states)):
                sampled_lists[row] = [tokens[j]]
                k = state.sampling_params.logprobs
                if k is not None:
                    n = len(lp_ids[j]) if k < 0 else 1 + k
                    logprobs[state.req_id] = (lp_ids[j][:n], lps[j][:n], ranks[j][:n])
        for row, _, emitted in self.spec:
            sampled_lists[row] = emitted
        if self.runner is not None:
            self.runner.land_sampled(self, self.states + [s for _, s, _ in self.spec],
                                     tokens + [t for _, _, t in self.spec])
        self._result = ModelRunnerOutput(self.req_ids, sampled_lists, logprobs, self.prompt_logprobs,
                                         routed_experts=split_routed(*self.routed) if self.routed is not None else {})
        self.runner = self.states = self.sampler_output = None
        return self._result
