"""ModelRunner: turns a SchedulerOutput into one flat batch, runs the model, samples."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backend import AttentionMetadata, get_attention_backend, kv_cache_shape
from pagedllm.config import EngineConfig
from pagedllm.core.messages import PositionLogprobs
from pagedllm.core.scheduler import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedllm.sample.sampler import Sampler, SamplingMetadata, compute_logprobs_with_ranks
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class CachedRequestState:
    """The worker's copy of a request, kept across steps (and across preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    prompt_ids_tensor: torch.Tensor | None = field(default=None, repr=False)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.dtype = _TORCH_DTYPES[config.model_config.dtype]
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.attn_backend = get_attention_backend(device)
        self.attn_layers = [m for m in model.modules() if hasattr(m, "kv_cache") and hasattr(m, "attn_backend")]
        for layer in self.attn_layers:
            layer.attn_backend = self.attn_backend
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []

    # ---- KV cache ---------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        return len(self.attn_layers) * int(np.prod(self._kv_shape(1))) * self.dtype.itemsize

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        layer = self.attn_layers[0]
        return kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        # Zeroed, so padded reads in a batched kernel only ever see finite values.
        self.kv_caches = [self._zeros(self._kv_shape(num_blocks)) for _ in self.attn_layers]
        for layer, cache in zip(self.attn_layers, self.kv_caches):
            layer.kv_cache = cache

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        # calloc hands out fresh zero pages without touching them: a 4 GiB CPU cache costs
        # no start-up time and only the memory actually written.
        nbytes = int(np.prod(shape)) * self.dtype.itemsize
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(self.dtype).view(shape)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One forward + sample at the largest step size, to measure peak activation memory."""
        bs = self.block_size
        num_blocks = -(-num_tokens // bs)
        saved = [layer.kv_cache for layer in self.attn_layers]
        for layer in self.attn_layers:
            layer.kv_cache = torch.zeros(self._kv_shape(num_blocks), dtype=self.dtype, device=self.device)
        try:
            positions = torch.arange(num_tokens, device=self.device)
            md = AttentionMetadata(
                num_actual_tokens=num_tokens, slot_mapping=positions.clone(),
                block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
                query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
                seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
                query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens],
                max_query_len=num_tokens, max_seq_len=num_tokens,
            )
            hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device), positions, md)
            num_rows = min(self.config.scheduler_config.max_num_seqs, num_tokens)
            logits = self.model.compute_logits(hidden[:num_rows])
            self.sampler(logits, SamplingMetadata(
                temperature=torch.ones(num_rows, device=self.device), all_greedy=False, all_random=True,
                top_p=torch.full((num_rows,), 0.9, device=self.device)))
        finally:
            for layer, cache in zip(self.attn_layers, saved):
                layer.kv_cache = cache

    # ---- one step ---------------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self._add_request(new)
        for cached in sched.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _add_request(self, new: NewRequestData) -> None:
        old = self.requests.get(new.req_id)  # resumed after preemption: keep its RNG stream
        generator = old.generator if old is not None else None
        params = new.sampling_params
        if generator is None and params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        self.requests[new.req_id] = CachedRequestState(
            req_id=new.req_id, token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids), sampling_params=params,
            block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens, generator=generator,
        )

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        req_ids = [c.req_id for c in sched.scheduled_cached_reqs] + [n.req_id for n in sched.scheduled_new_reqs]
        if not req_ids:
            return ModelRunnerOutput([], [])
        batch = self._prepare_inputs(req_ids, sched.num_scheduled_tokens)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata)

        sample_rows = [i for i, r in enumerate(req_ids) if batch.completes[i]]
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, PositionLogprobs] = {}
        if sample_rows:
            states = [self.requests[req_ids[i]] for i in sample_rows]
            idx = torch.tensor([batch.query_start_loc[i + 1] - 1 for i in sample_rows], device=self.device)
            logits = self.model.compute_logits(hidden[idx])
            out = self.sampler(logits, self._sampling_metadata(states))
            tokens = out.sampled_token_ids.tolist()
            if out.logprobs is not None:
                lp_ids, lps, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist()
            for j, (row, state) in enumerate(zip(sample_rows, states)):
                state.token_ids.append(tokens[j])
                sampled_lists[row] = [tokens[j]]
                k = state.sampling_params.logprobs
                if k is not None:
                    n = len(lp_ids[j]) if k < 0 else 1 + k
                    logprobs[state.req_id] = (lp_ids[j][:n], lps[j][:n], ranks[j][:n])
        prompt_logprobs = self._prompt_logprobs(req_ids, batch, hidden)
        return ModelRunnerOutput(req_ids, sampled_lists, logprobs, prompt_logprobs)

    @dataclass
    class _Batch:
        input_ids: torch.Tensor
        positions: torch.Tensor
        attn_metadata: AttentionMetadata
        query_start_loc: list[int]
        starts: list[int]  # num_computed_tokens of each request before this step
        completes: list[bool]  # this step reaches the request's last token: sample

    def _prepare_inputs(self, req_ids: list[str], num_scheduled: dict[str, int]) -> "_Batch":
        bs = self.block_size
        counts = [num_scheduled[r] for r in req_ids]
        total = sum(counts)
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slots = np.empty(total, dtype=np.int64)
        max_blocks = max(len(self.requests[r].block_ids) for r in req_ids)
        block_tables = np.zeros((len(req_ids), max_blocks), dtype=np.int32)
        qsl, seq_lens, starts, completes = [0], [], [], []
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            start, n = state.num_computed_tokens, counts[i]
            end = start + n
            lo = qsl[-1]
            pos = np.arange(start, end)
            positions[lo:lo + n] = pos
            input_ids[lo:lo + n] = state.token_ids[start:end]
            table = np.asarray(state.block_ids, dtype=np.int64)
            slots[lo:lo + n] = table[pos // bs] * bs + pos % bs
            block_tables[i, :len(table)] = table
            qsl.append(lo + n)
            seq_lens.append(end)
            starts.append(start)
            completes.append(end == len(state.token_ids))
            state.num_computed_tokens = end
        dev = self.device
        md = AttentionMetadata(
            num_actual_tokens=total,
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            max_query_len=max(counts), max_seq_len=max(seq_lens),
        )
        return self._Batch(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), md,
                           qsl, starts, completes)

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        dev = self.device
        params = [s.sampling_params for s in states]
        temps = [p.temperature for p in params]
        md = SamplingMetadata(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            all_greedy=all(t == 0.0 for t in temps),
            all_random=all(t != 0.0 for t in temps),
        )
        # Output histories are only read by penalties, bad words and logits processors.
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
               or p.logits_processors for p in params):
            md.output_token_ids = [s.output_token_ids for s in states]
        if any(p.top_p < 1.0 for p in params):
            md.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        if any(p.top_k > 0 for p in params):
            md.top_k = torch.tensor([min(p.top_k or self.vocab_size, self.vocab_size) for p in params],
                                    dtype=torch.long, device=dev)
        if any(p.min_p > 0.0 for p in params):
            md.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        md.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            md.max_num_logprobs = -1 if -1 in wanted else max(wanted)
        if any(p.presence_penalty != 0.0 for p in params):
            md.presence_penalties = torch.tensor([p.presence_penalty for p in params], device=dev)
        if any(p.frequency_penalty != 0.0 for p in params):
            md.frequency_penalties = torch.tensor([p.frequency_penalty for p in params], device=dev)
        if any(p.repetition_penalty != 1.0 for p in params):
            md.repetition_penalties = torch.tensor([p.repetition_penalty for p in params], device=dev)
            md.prompt_token_ids = self._padded_prompts(states)
        if any(p.allowed_token_ids for p in params):
            mask = torch.zeros(len(states), self.vocab_size, dtype=torch.bool)
            for i, p in enumerate(params):
                if p.allowed_token_ids:
                    mask[i] = True
                    mask[i, p.allowed_token_ids] = False
            md.allowed_token_ids_mask = mask.to(dev)
        for i, (s, p) in enumerate(zip(states, params)):
            if p.logit_bias:
                md.logit_bias[i] = {int(k): float(v) for k, v in p.logit_bias.items()}
            banned = self._banned_tokens(s)
            if banned:
                md.banned_token_ids[i] = banned
            if p.logits_processors:
                md.logits_processors[i] = (p.logits_processors, s.token_ids[:s.num_prompt_tokens])
        return md

    @staticmethod
    def _banned_tokens(state: CachedRequestState) -> list[int]:
        """Tokens this request may not sample now: stop/EOS before min_tokens, and the last
        token of any bad word whose other tokens were just generated."""
        p = state.sampling_params
        out = state.output_token_ids
        banned: list[int] = []
        if len(out) < p.min_tokens:
            banned.extend(p._all_stop_token_ids)
        for word in p._bad_words_token_ids:
            prefix = word[:-1]
            if len(out) >= len(prefix) and (not prefix or out[len(out) - len(prefix):] == prefix):
                banned.append(word[-1])
        return banned

    def _padded_prompts(self, states: list[CachedRequestState]) -> torch.Tensor:
        width = max(s.num_prompt_tokens for s in states)
        out = torch.full((len(states), width), self.vocab_size, dtype=torch.long)
        for i, s in enumerate(states):
            out[i, :s.num_prompt_tokens] = torch.tensor(s.token_ids[:s.num_prompt_tokens])
        return out.to(self.device)

    def _prompt_logprobs(self, req_ids: list[str], batch: "_Batch", hidden: torch.Tensor
                         ) -> dict[str, list[PositionLogprobs]]:
        """Logprobs of prompt tokens 1.. for the positions this step computed (chunk by chunk)."""
        result: dict[str, list[PositionLogprobs]] = {}
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            k = state.sampling_params.prompt_logprobs
            start = batch.starts[i]
            end = min(start + (batch.query_start_loc[i + 1] - batch.query_start_loc[i]), state.num_prompt_tokens - 1)
            if k is None or start >= end:
                continue
            lo = batch.query_start_loc[i]
            logits = self.model.compute_logits(hidden[lo:lo + end - start])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor(state.token_ids[start + 1:end + 1], device=self.device)
            num_top = logprobs.shape[-1] if k < 0 else k
            ids, lps, ranks = compute_logprobs_with_ranks(logprobs, targets, num_top)
            result[req_id] = list(zip(ids.tolist(), lps.tolist(), ranks.tolist()))
        return result
