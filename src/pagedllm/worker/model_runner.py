"""ModelRunner: turns a SchedulerOutput into one flat batch, runs the model, samples.

The pieces it drives: ``InputBatch`` (the persistent per-request rows, sampling values
included), ``SamplingMetadataBuilder`` (a step's sampling tensors from those rows),
``DeviceBuffers`` (pinned staging and fixed device inputs) and ``CudaGraphs`` (decode graphs,
the piecewise graphs of steps with prefill chunks; start-up warm-up and compile dry run).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backend import AttentionMetadata, kv_cache_shape
from pagedllm.attention.kv_quant import kv_cache_torch_dtype
from pagedllm.attention.selector import get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_groups import make_kv_cache_groups
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed import get_pp_size, is_first_pp_rank, is_last_pp_rank, pp_recv, pp_send
from pagedllm.model.loader import TORCH_DTYPES
from pagedllm.sample.metadata import SamplingMetadataBuilder
from pagedllm.sample.sampler import Sampler, SamplingMetadata
from pagedllm.structured_output.bitmask import apply_grammar
from pagedllm.worker import cuda_graphs
from pagedllm.worker.cuda_graphs import CudaGraphs
from pagedllm.worker.device_buffers import DeviceBuffers
from pagedllm.lora.manager import lora_manager_for
from pagedllm.worker.input_batch import CachedRequestState, InputBatch
from pagedllm.worker.kv_cache import allocate_kv_caches, check_fp8_kv_cache, place_layers
from pagedllm.worker.pending_output import PendingOutput
from pagedllm.worker.piecewise_graphs import piecewise_graphs_for
from pagedllm.worker.pooling import PoolingSteps
from pagedllm.worker.prompt_logprobs import prompt_logprobs
from pagedllm.worker.spec_draft import DraftModel, draft_scope
from pagedllm.worker.spec_eagle import Eagle3Proposer, EagleProposer
from pagedllm.worker.routed_experts import RoutedExpertsCapture
from pagedllm.worker.spec_verify import verify_drafts

logger = logging.getLogger("pagedllm")


@dataclass
class _Batch:
    """One step's flat inputs, on the device."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata | None  # None when a CUDA graph replays the step
    num_tokens: int
    query_start_loc: list[int]
    starts: list[int]  # num_computed_tokens of each request before this step
    graph_size: int | None  # replay the CUDA graph of this padded batch size
    piece_size: int | None  # else the piecewise graphs of this padded token count (None: eagerly)
    sample_rows: list[int]  # the requests that reach their last known token this step: they sample
    sample_batch_rows: np.ndarray  # their rows in the input batch
    sample_index: torch.Tensor | None  # their last tokens' rows of the flat batch (None: all, a decode)
    temperature: torch.Tensor | None  # their temperatures, on the device (one per logits row)
    num_drafts: list[int] | None = None  # per sampling request: its proposed tokens (None: no drafts)
    graph_q: int = 1  # tokens per request of the replayed graph (1 + k: a speculative step)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device,
                 draft_model: nn.Module | None = None) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.dtype = TORCH_DTYPES[config.model_config.dtype]
        self.block_size = config.cache_config.block_size
        self.kv_dtype = kv_cache_torch_dtype(config.cache_config.cache_dtype, self.dtype)
        self.vocab_size = config.model_config.vocab_size
        self.attn_backend = get_attention_backend(device)
        self.attn_layers = [m for m in model.modules() if hasattr(m, "kv_cache") and hasattr(m, "attn_backend")]
        for layer in self.attn_layers:
            layer.attn_backend = self.attn_backend
        # KV cache groups (core/kv_cache_groups.py): each layer's group and its cache tensor (slot).
        self.kv_groups = make_kv_cache_groups(config.model_config.layer_sliding_windows or [None])
        self._kv_slots = place_layers(self.attn_layers, self.kv_groups, type(model).__name__)
        self.sampler = Sampler()
        # Pipeline parallelism: this stage's place; only the last stage computes logits and samples.
        self.pp_size, self.is_first_stage, self.is_last_stage = get_pp_size(), is_first_pp_rank(), is_last_pp_rank()
        self.hidden_size = config.model_config.hf_config.hidden_size
        self._pp_sends: list = []  # activations still being sent to the next stage
        self.kv_caches: list[torch.Tensor] = []

        sc = config.scheduler_config
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        max_blocks_per_req = -(-sc.max_model_len // self.block_size)
        self.input_batch = InputBatch(self.max_num_reqs, sc.max_model_len, max_blocks_per_req, self.vocab_size,
                                      device, num_kv_groups=len(self.kv_groups))
        self.requests = self.input_batch.requests  # the same dict: req_id -> CachedRequestState
        self._free_rows = self.input_batch.free_rows  # the same list (read by tests)
        ib = self.input_batch
        self.sampling_metadata = SamplingMetadataBuilder(ib.sampling, ib.sampling_counts, ib.token_ids_cpu,
                                                         ib.num_prompt_tokens, self.vocab_size, device)
        self._buffers = DeviceBuffers(self.max_num_tokens, self.max_num_reqs, max_blocks_per_req, device, len(self.kv_groups))
        spec = config.speculative_config
        self.graphs = CudaGraphs(self._buffers, device, getattr(self.attn_backend, "cuda_graph_safe", False),
                                 self.pp_size, self.max_num_reqs, self.max_num_tokens, sc.max_model_len,
                                 max_spec_q=None if spec is None else 1 + spec.num_speculative_tokens,
                                 decodes=config.model_config.runner_type != "pooling")
        self.lora = lora_manager_for(self.input_batch, config, model, device, self.dtype)
        # Speculative decoding with a draft model or an EAGLE head (worker/spec_draft.py, spec_eagle.py).
        proposer = {"eagle": EagleProposer, "eagle3": Eagle3Proposer}.get(spec.method, DraftModel) if spec else None
        self.draft = None if draft_model is None else proposer(self, draft_model, spec.num_speculative_tokens)
        # Async scheduling: the last step's sampled tokens, still on the device.
        self._pending: PendingOutput | None = None
        self._deferred: tuple | None = None  # a defer_grammar step waiting for sample_tokens
        self._prev_sampled: torch.Tensor | None = None
        self._prev_index: dict[str, int] = {}
        self.routed_experts = None  # enable_return_routed_experts: rows by KV slot, beside the cache
        if config.model_config.enable_return_routed_experts:
            self.routed_experts = RoutedExpertsCapture(model, max(self.max_num_tokens, self.max_num_reqs + 16),
                                                       self.block_size, device)
        # Pooling models (worker/pooling.py): prompts in, pooled outputs back, nothing sampled.
        self.pooling = PoolingSteps(model, config.model_config, device) \
            if config.model_config.runner_type == "pooling" else None
        # What lives beside the KV cache, block for block: the draft's cache, the routed experts.
        self._kv_extras = [x for x in (self.draft, self.routed_experts) if x is not None]
        # FP8 KV cache with calculate_kv_scales: the first real step sets every layer's scales.
        all_attn = self.attn_layers + (self.draft.attn_layers if self.draft else [])
        self._kv_scales_pending = check_fp8_kv_cache(config.cache_config, self.kv_dtype, all_attn, device)
        self.graphs.piecewise = piecewise_graphs_for(self)

    # ---- KV cache ---------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        extras = sum(x.bytes_per_block() for x in self._kv_extras)
        return len(set(self._kv_slots)) * int(np.prod(self._kv_shape(1))) * self.kv_dtype.itemsize + extras

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        layer = self.attn_layers[0]
        return kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.attn_layers, self._kv_slots, self._kv_shape(num_blocks),
                                            self.kv_dtype, self.device)
        for extra in self._kv_extras:
            extra.allocate(num_blocks)

    def free_kv_cache(self) -> None:
        """Drop every reference to the KV cache (sleep mode; initialize_kv_cache rebuilds it), graphs too."""
        self.release_cuda_graphs()
        self.kv_caches = []
        for layer in self.attn_layers:
            layer.kv_cache = None
        for extra in self._kv_extras:
            extra.free()

    @contextlib.contextmanager
    def scratch_kv_cache(self, num_blocks: int):
        """Within: every attention layer reads and writes a zeroed cache of ``num_blocks``
        blocks instead of its own (start-up forwards that must leave the real one alone)."""
        saved = [layer.kv_cache for layer in self.attn_layers]
        for layer in self.attn_layers:
            layer.kv_cache = torch.zeros(self._kv_shape(num_blocks), dtype=self.kv_dtype, device=self.device)
        try:
            yield
        finally:
            for layer, cache in zip(self.attn_layers, saved):
                layer.kv_cache = cache

    # ---- start-up forwards and CUDA graphs (worker/cuda_graphs.py) ---------------------------
    def profile_run(self, num_tokens: int) -> None:
        cuda_graphs.profile_run(self, num_tokens)

    def compile_dry_run(self) -> None:
        cuda_graphs.compile_dry_run(self)

    def warm_up_kernels(self) -> None:
        cuda_graphs.warm_up_kernels(self)

    def capture_cuda_graphs(self) -> None:
        self.graphs.capture(self.model, self.lora)
        if self.draft is not None:
            with draft_scope(self.config):
                self.draft.capture_cuda_graphs()

    def release_cuda_graphs(self) -> None:
        self.graphs.release()
        if self.draft is not None:
            self.draft.release_cuda_graphs()
        # The last step's sampled tokens may live in a graph's pool.
        self._prev_sampled = None
        self._prev_index = {}

    @property
    def cuda_graphs(self) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
        return self.graphs.graphs

    # ---- pipeline parallelism ------------------------------------------------------------------
    def dummy_intermediate(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Zero activations for a forward that talks to no other stage (profiling, warm-up)."""
        if self.is_first_stage:
            return None
        h = torch.zeros(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        return h, h.clone()

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata):
        """This stage's forward: the previous stage's activations in, the next stage's out (a
        stage before the last returns None)."""
        if self.pp_size == 1:
            return self.model(input_ids, positions, md)
        intermediate = None
        if not self.is_first_stage:
            n = input_ids.shape[0]
            intermediate = tuple(pp_recv([torch.empty(n, self.hidden_size, dtype=self.dtype, device=self.device)
                                          for _ in range(2)]))
        out = self.model(input_ids, positions, md, intermediate)
        if self.is_last_stage:
            return out
        for handle in self._pp_sends:  # the last step's activations are out before these go
            handle.wait()
        self._pp_sends = pp_send(list(out))
        return None

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput, non_block: bool = False):
        """Run one step. With ``non_block`` the sampled tokens stay in flight: the return is a
        handle whose ``result()`` waits for them, and the next step may be launched first
        (async scheduling: its decodes read their input tokens from the device)."""
        self.input_batch.update(sched)
        if self.pooling is not None:
            self.pooling.track(sched)
        req_ids = [c.req_id for c in sched.scheduled_cached_reqs] + [n.req_id for n in sched.scheduled_new_reqs]
        if not req_ids:
            return PendingOutput.done(ModelRunnerOutput([], [])) if non_block else ModelRunnerOutput([], [])
        states = [self.requests[r] for r in req_ids]
        rows = self.input_batch.rows_of(states)
        if self._pending is not None and self._needs_known_outputs(states, rows):
            self._pending.result()  # penalties / bad words / processors read the exact history
        lora_ids = self._step_lora_ids(sched, rows) if self.lora is not None else None
        batch = self._prepare_inputs(states, rows, sched.num_scheduled_tokens, sched.scheduled_spec_decode_tokens,
                                     lora=lora_ids is not None)
        if lora_ids is not None:  # the adapters into device slots, the tokens mapped to them
            counts = np.fromiter((sched.num_scheduled_tokens[s.req_id] for s in states), dtype=np.int64,
                                 count=len(states))
            self.lora.prepare_step(lora_ids, counts, batch.graph_size or batch.piece_size)
        if batch.graph_size is not None:
            hidden = self.graphs.replay(batch.graph_size, batch.num_tokens, lora=lora_ids is not None, q=batch.graph_q)
        elif batch.piece_size is not None:
            hidden = self.graphs.piecewise.replay(batch.piece_size, batch.num_tokens, batch.attn_metadata,
                                                  lora=lora_ids is not None)
        elif self.pooling is not None and self.pooling.is_encoder:
            hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata,
                                token_type_ids=self.pooling.token_types(states, batch.query_start_loc, batch.num_tokens))
        else:
            hidden = self._run_model(batch.input_ids, batch.positions, batch.attn_metadata)
        if lora_ids is not None:
            self.lora.clear_mapping()
        if self.draft is not None:  # the draft's cache follows the target's positions
            with draft_scope(self.config):
                self.draft.follow(batch, hidden)
        if not self.is_last_stage:  # the last stage samples; the engine reads its output
            output = ModelRunnerOutput(req_ids, [[] for _ in req_ids])
            return PendingOutput.done(output) if non_block else output
        if self.pooling is not None:  # the prompts that ended this step are pooled
            pooled = self.pooling.pool(states, batch.query_start_loc, batch.starts, set(batch.sample_rows), hidden)
            output = ModelRunnerOutput(req_ids, [[] for _ in req_ids], pooler_output=pooled)
            return PendingOutput.done(output) if non_block else output

        sample_rows = batch.sample_rows
        pending = PendingOutput(self, req_ids, sample_rows)
        deferred = None
        if sample_rows:
            sampling = [states[i] for i in sample_rows]
            last_hidden = hidden[:batch.num_tokens] if batch.sample_index is None else hidden[batch.sample_index]
            logits = self.model.compute_logits(  # under TP a vocabulary slice where the sampler may take it
                last_hidden, shard=batch.num_drafts is None and not sched.defer_grammar and sched.grammar is None)
            if batch.num_drafts is not None:  # speculative decoding: drafted requests verify theirs
                if sched.defer_grammar:
                    raise RuntimeError("a step with speculative tokens cannot defer its grammar masks")
                for state in sampling:
                    state.num_inflight += 1
                sampling, logits, md = verify_drafts(self, sched, states, batch, logits, pending)
                self._sample(pending, sampling, logits, md)
            elif sched.defer_grammar:  # the masks come with sample_tokens, once the step in flight landed
                deferred = (pending, sampling, logits, batch)
            else:
                self._sample_masked(pending, sampling, logits, batch, sched.grammar)
        pending.prompt_logprobs = prompt_logprobs(self.model, states, batch.starts, batch.query_start_loc, hidden)
        if self.routed_experts is not None:
            pending.routed = self.routed_experts.collect(sched, req_ids, self.input_batch.block_table_cpu, rows,
                                                         batch.starts, batch.query_start_loc)
        if self.draft is not None:  # the step's tokens land, then the draft guesses the next ones
            output = pending.result()
            with draft_scope(self.config):
                output = self.draft.after_step(output)
            return PendingOutput.done(output) if non_block else output
        if sched.defer_grammar:
            self._deferred = (pending, None, None, None) if deferred is None else deferred
            return pending if non_block else None
        if non_block:
            self._pending = pending
            return pending
        return pending.result()

    @torch.inference_mode()
    def sample_tokens(self, grammar, non_block: bool = False):
        """Finish the step launched with ``defer_grammar``: apply ``grammar`` (the masks of its
        constrained rows, or None) and sample. Returns that step's handle (``non_block``) or its
        ModelRunnerOutput."""
        if self._deferred is None:
            raise RuntimeError("sample_tokens() without a step launched with defer_grammar")
        (pending, sampling, logits, batch), self._deferred = self._deferred, None
        if sampling is not None:
            self._sample_masked(pending, sampling, logits, batch, grammar)
        if non_block:
            self._pending = pending
            return pending
        return pending.result()

    def _sample_masked(self, pending: "PendingOutput", sampling: list[CachedRequestState], logits: torch.Tensor,
                       batch: "_Batch", grammar) -> None:
        if grammar is not None:  # structured outputs: constrained rows keep allowed tokens only
            apply_grammar(logits, grammar, [s.req_id for s in sampling])
        md = self.sampling_metadata.build(sampling, batch.sample_batch_rows, batch.temperature)
        for state in sampling:
            state.num_inflight += 1
        self._sample(pending, sampling, logits, md)

    def _sample(self, pending: "PendingOutput", sampling: list[CachedRequestState], logits: torch.Tensor,
                md) -> None:
        if sampling:
            out = self.sampler(logits, md)
            pending.launch_copy(sampling, out, self._buffers.sampled_tokens_host(len(sampling)))
            self._prev_sampled = out.sampled_token_ids
            self._prev_index = {state.req_id: j for j, state in enumerate(sampling)}

    def land_sampled(self, pending: "PendingOutput", states: list[CachedRequestState], tokens: list[int]) -> None:
        """A step's sampled tokens reached the host: they join their requests' rows, and
        ``pending`` (that step's handle) is no longer the one in flight."""
        self.input_batch.append_sampled(states, tokens)
        if self._pending is pending:
            self._pending = None

    def _step_lora_ids(self, sched: SchedulerOutput, rows: np.ndarray) -> np.ndarray | None:
        """Each request's adapter id this step (0: none), or None when no request has one."""
        for new in sched.scheduled_new_reqs:
            if new.lora_request is not None:
                self.lora.add_request(new.lora_request)
        ids = self.input_batch.columns["lora_id"][rows]
        return ids if ids.any() else None

    def _needs_known_outputs(self, states: list[CachedRequestState], rows: np.ndarray) -> bool:
        history = self.sampling_metadata.needs_history(rows)
        return history is not None and any(s.num_inflight for s, h in zip(states, history.tolist()) if h)

    def _graph_for(self, counts: np.ndarray, total: int, lora: bool) -> tuple[int | None, int | None]:
        """(tokens per request, captured size) of the CUDA graph a step replays: a pure decode,
        or q tokens for every request (speculation's 1 + k); (None, None) when none fits."""
        q = total // len(counts)
        if total % len(counts) or not (counts == q).all() or self._kv_scales_pending:
            return None, None  # (the step that computes FP8 KV scales runs eagerly)
        return q, self.graphs.size_for(len(counts), lora, q=q)

    def upload_graph_inputs(self, input_ids: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray,
                            tables: list[tuple[np.ndarray, np.ndarray]], graph_size: int, q: int = 1
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """A graph step's inputs into the fixed buffers, padded to ``graph_size`` requests of
        ``q`` tokens (padding writes no slot); the input ids and positions on the device."""
        buf, n = self._buffers, graph_size * q
        ids_d = buf.upload("input_ids", input_ids, n, pad=0)
        pos_d = buf.upload("positions", positions, n, pad=0)
        buf.upload("seq_lens", seq_lens, graph_size, pad=q)
        buf.upload_step_tables(tables, n)
        return ids_d, pos_d

    def _prepare_inputs(self, states: list[CachedRequestState], rows: np.ndarray, num_scheduled: dict[str, int],
                        drafts: dict[str, list[int]], lora: bool = False) -> _Batch:
        """The flat batch, built with vectorized gathers from the input batch's rows."""
        bs, ib = self.block_size, self.input_batch
        num_reqs = len(states)
        counts = np.fromiter((num_scheduled[s.req_id] for s in states), dtype=np.int64, count=num_reqs)
        starts = [s.num_computed_tokens for s in states]
        total = int(counts.sum())
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        starts_np = np.asarray(starts, dtype=np.int64)
        seq_lens = starts_np + counts
        if total == num_reqs:  # decode only: one token per request
            token_rows, positions = rows, starts_np
        else:
            token_rows = np.repeat(rows, counts)
            positions = np.repeat(starts_np - qsl[:-1], counts) + np.arange(total)
        input_ids = ib.token_ids_cpu[token_rows, positions]
        # Each KV cache group's block tables and slots (one group: one pair).
        tables = ib.step_tables(rows, token_rows, positions, -(-int(seq_lens.max()) // bs), bs)
        num_drafts = [len(drafts.get(s.req_id, ())) for s in states] if drafts else [0] * num_reqs
        completes = [end == len(s.token_ids) + s.num_inflight + k
                     for end, s, k in zip(seq_lens.tolist(), states, num_drafts)]
        # Inputs still in flight (async scheduling): the previous step's samples, on the device.
        inflight = [(int(qsl[i]) + len(s.token_ids) - starts[i], self._prev_index[s.req_id])
                    for i, s in enumerate(states) if s.num_inflight]
        for s, end in zip(states, seq_lens.tolist()):
            s.num_computed_tokens = end

        q, graph_size = self._graph_for(counts, total, lora)
        piece_size = None if graph_size is not None else self.graphs.piece_size(total, self._kv_scales_pending, lora)
        buf = self._buffers
        qsl_list = qsl.tolist()
        buf.begin_step()
        md = None  # a replayed graph reads the same buffers through its captured metadata
        if graph_size is not None:
            ids_d, pos_d = self.upload_graph_inputs(input_ids, positions, seq_lens, tables, graph_size, q)
        else:
            ids_d = buf.upload("input_ids", input_ids, piece_size)  # padded rows: token 0 at position 0
            pos_d = buf.upload("positions", positions, piece_size)
            seq_d = buf.upload("seq_lens", seq_lens)
            qsl_d = buf.upload("query_start_loc", qsl)
            (bt_d, slots_d), *group_tables = buf.upload_step_tables(tables, piece_size)  # pieces: padded, -1
            md = AttentionMetadata(
                num_actual_tokens=total, slot_mapping=slots_d, block_tables=bt_d, query_start_loc=qsl_d,
                seq_lens=seq_d, query_start_loc_cpu=qsl_list, seq_lens_cpu=seq_lens.tolist(),
                max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()),
                calculate_kv_scales=self._kv_scales_pending,
            )
            if group_tables:  # layers of KV cache groups 1.. read their own (for_group)
                md.with_groups(group_tables)
            self._kv_scales_pending = False
        if inflight:
            dst, src = (buf.upload(name, np.fromiter(x, dtype=np.int64, count=len(inflight)))
                        for name, x in zip(("inflight_dst", "inflight_src"), zip(*inflight)))
            ids_d[dst] = self._prev_sampled[src]
        # What sampling needs on the device goes up with the rest, through the pinned buffers:
        # a copy from pageable memory may wait for the stream, stalling the host while the
        # device drains.
        sample_rows = [i for i, c in enumerate(completes) if c]
        sample_batch_rows = rows if len(sample_rows) == num_reqs else rows[sample_rows]
        temperature = sample_index = spec_counts = None
        if sample_rows and drafts:  # every verified position samples: k + 1 rows for k drafts
            spec_counts = [num_drafts[i] for i in sample_rows]
            ends = qsl[np.asarray(sample_rows) + 1]
            index = np.concatenate([np.arange(e - 1 - k, e) for e, k in zip(ends.tolist(), spec_counts)])
            temperature = buf.upload("temperature", self.sampling_metadata.temperature(
                np.repeat(sample_batch_rows, np.asarray(spec_counts) + 1)))
            sample_index = buf.upload("sample_index", index)
        elif sample_rows:
            temperature = buf.upload("temperature", self.sampling_metadata.temperature(sample_batch_rows))
            if len(sample_rows) != total:
                sample_index = buf.upload("sample_index", qsl[np.asarray(sample_rows) + 1] - 1)
        buf.end_step()
        return _Batch(ids_d, pos_d, md, total, qsl_list, starts, graph_size, piece_size, sample_rows,
                      sample_batch_rows, sample_index, temperature, spec_counts, graph_q=q or 1)
