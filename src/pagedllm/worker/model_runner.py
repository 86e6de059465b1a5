"""ModelRunner: turns a SchedulerOutput into one flat batch, runs the model, samples."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backend import AttentionMetadata, kv_cache_shape
from pagedllm.attention.selector import get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.core.messages import PositionLogprobs
from pagedllm.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedllm.distributed import get_pp_size, is_first_pp_rank, is_last_pp_rank, pp_recv, pp_send
from pagedllm.model.loader import TORCH_DTYPES
from pagedllm.sample.sampler import Sampler, SamplingMetadata, compute_logprobs_with_ranks
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


@dataclass
class CachedRequestState:
    """The worker's copy of a request, kept across steps (and across preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    row: int  # this request's row in the runner's persistent token / block-table arrays
    generator: torch.Generator | None = None
    features: frozenset[str] = frozenset()  # the sampling features it uses (see sampling_features)
    num_inflight: int = 0  # sampled by a step whose result is not read yet (async scheduling)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


# Features that read the exact output history, so an in-flight step must land first.
_HISTORY_FEATURES = frozenset({"presence", "frequency", "repetition", "procs", "ban"})


def sampling_features(p: SamplingParams) -> frozenset[str]:
    """Which optional sampler inputs a request needs, so a step builds only those."""
    f = set()
    if p.top_p < 1.0:
        f.add("top_p")
    if p.top_k > 0:
        f.add("top_k")
    if p.min_p > 0.0:
        f.add("min_p")
    if p.logprobs is not None:
        f.add("logprobs")
    if p.presence_penalty != 0.0:
        f.add("presence")
    if p.frequency_penalty != 0.0:
        f.add("frequency")
    if p.repetition_penalty != 1.0:
        f.add("repetition")
    if p.allowed_token_ids:
        f.add("allowed")
    if p.logit_bias:
        f.add("bias")
    if p.min_tokens > 0 or p.bad_words_token_ids:
        f.add("ban")
    if p.logits_processors:
        f.add("procs")
    return frozenset(f)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.dtype = TORCH_DTYPES[config.model_config.dtype]
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.attn_backend = get_attention_backend(device)
        self.attn_layers = [m for m in model.modules() if hasattr(m, "kv_cache") and hasattr(m, "attn_backend")]
        for layer in self.attn_layers:
            layer.attn_backend = self.attn_backend
        self.sampler = Sampler()
        # Pipeline parallelism: this stage's place; only the last stage computes logits and samples.
        self.pp_size, self.is_first_stage, self.is_last_stage = get_pp_size(), is_first_pp_rank(), is_last_pp_rank()
        self.hidden_size = config.model_config.hf_config.hidden_size
        self._pp_sends: list = []  # activations still being sent to the next stage
        self.requests: dict[str, CachedRequestState] = {}
        # Seeded requests that were preempted keep their RNG stream until they resume.
        self._preempted_generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[torch.Tensor] = []

        sc = config.scheduler_config
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_blocks_per_req = -(-sc.max_model_len // self.block_size)
        # Persistent host arrays, one row per running request (rows are reused): every
        # request's tokens and block table, so a step's inputs are a few vectorized gathers
        # instead of per-request Python work. np.zeros is calloc: untouched rows cost nothing.
        self._free_rows = list(range(self.max_num_reqs - 1, -1, -1))
        self.token_ids_cpu = np.zeros((self.max_num_reqs, sc.max_model_len), dtype=np.int64)
        self.block_table_cpu = np.zeros((self.max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        self._buffers = _DeviceBuffers(self.max_num_tokens, self.max_num_reqs, self.max_blocks_per_req, device)
        # CUDA graphs of decode steps, by padded batch size (filled by capture_cuda_graphs).
        self.cuda_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Async scheduling: the last step's sampled tokens, still on the device.
        self._pending: _PendingOutput | None = None
        self._prev_sampled: torch.Tensor | None = None
        self._prev_index: dict[str, int] = {}
        self._sampled_host = [torch.zeros(self.max_num_reqs, dtype=torch.int64, pin_memory=device.type == "cuda")
                              for _ in range(2)]  # double-buffered: step N+1 copies while N is read
        self._sampled_host_turn = 0
        self._graph_sizes: list[int] = []

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

    def free_kv_cache(self) -> None:
        """Drop every reference to the KV cache (sleep mode); initialize_kv_cache rebuilds it.
        The CUDA graphs read the cache's addresses, so they go too."""
        self.release_cuda_graphs()
        self.kv_caches = []
        for layer in self.attn_layers:
            layer.kv_cache = None

    def release_cuda_graphs(self) -> None:
        """Forget the captured graphs (and their memory pool); steps run eagerly until
        capture_cuda_graphs runs again."""
        self.cuda_graphs = {}
        self._graph_sizes = []
        # The last step's sampled tokens may live in a graph's pool.
        self._prev_sampled = None
        self._prev_index = {}

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        # calloc hands out fresh zero pages without touching them: a 4 GiB CPU cache costs
        # no start-up time and only the memory actually written.
        nbytes = int(np.prod(shape)) * self.dtype.itemsize
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(self.dtype).view(shape)

    @contextlib.contextmanager
    def _scratch_kv_cache(self, num_blocks: int):
        """Within: every attention layer reads and writes a zeroed cache of ``num_blocks``
        blocks instead of its own (start-up forwards that must leave the real one alone)."""
        saved = [layer.kv_cache for layer in self.attn_layers]
        for layer in self.attn_layers:
            layer.kv_cache = torch.zeros(self._kv_shape(num_blocks), dtype=self.dtype, device=self.device)
        try:
            yield
        finally:
            for layer, cache in zip(self.attn_layers, saved):
                layer.kv_cache = cache

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One forward + sample at the largest step size, to measure peak activation memory."""
        num_blocks = -(-num_tokens // self.block_size)
        with self._scratch_kv_cache(num_blocks):
            positions = torch.arange(num_tokens, device=self.device)
            md = AttentionMetadata(
                num_actual_tokens=num_tokens, slot_mapping=positions.clone(),
                block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
                query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
                seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
                query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens],
                max_query_len=num_tokens, max_seq_len=num_tokens,
            )
            hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device), positions, md,
                                self._dummy_intermediate(num_tokens))
            if not self.is_last_stage:
                return
            num_rows = min(self.config.scheduler_config.max_num_seqs, num_tokens)
            logits = self.model.compute_logits(hidden[:num_rows])
            self.sampler(logits, SamplingMetadata(
                temperature=torch.ones(num_rows, device=self.device), all_greedy=False, all_random=True,
                top_p=torch.full((num_rows,), 0.9, device=self.device)))

    @torch.inference_mode()
    def compile_dry_run(self) -> None:
        """Start-up's forwards in miniature, for ``pagedllm.ops.precompile`` to see which Triton
        kernels they compile (its hook skips those launches): the profiling forward (at a
        token count that Triton specializes alike: a multiple of 16 or not), the warm-up step,
        and decode forwards at the graph sizes up to 32 and the largest (the sizes where the
        launch choices change: one row, the small-row GEMM's 16- and 32-row tiles, split-KV
        attention or not). Reads and writes only a 4-block scratch KV cache."""
        n = self.config.scheduler_config.max_num_batched_tokens
        self.profile_run(n if n <= 80 else 64 if n % 16 == 0 else 65)
        with self._scratch_kv_cache(4):
            self.warm_up_kernels()
            if self.config.model_config.enforce_eager or self.pp_size > 1 \
                    or not getattr(self.attn_backend, "cuda_graph_safe", False):
                return
            buf = self._reset_graph_inputs()
            sizes = self.cuda_graph_sizes()
            for bs in [s for s in sizes if s <= 32] + [sizes[-1]]:
                self.model(buf.input_ids[:bs], buf.positions[:bs], self._graph_metadata(bs))

    # ---- CUDA graphs -------------------------------------------------------------------------
    def cuda_graph_sizes(self) -> list[int]:
        """The padded batch sizes captured: 1, 2, 4, 8, then every 16 up to max_num_seqs."""
        limit = min(self.max_num_reqs, self.max_num_tokens)
        sizes = [b for b in (1, 2, 4, 8) if b < limit] + list(range(16, limit, 16)) + [limit]
        return sorted(set(sizes))

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Compile, at start-up, the kernel variants that neither the profiling forward (one
        long prefill) nor graph capture (pure decodes) reach: a mixed step of a decode and a
        two-token chunk, the one-pass sampler, and the LM head's small-row GEMMs. Otherwise
        the first such step of a run pays Triton's compile time. Nothing is written to the KV
        cache (slots are -1)."""
        dev = self.device
        md = AttentionMetadata(
            num_actual_tokens=3, slot_mapping=torch.full((3,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(2, 1, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([1, 2], dtype=torch.int32, device=dev),
            query_start_loc_cpu=[0, 1, 3], seq_lens_cpu=[1, 2], max_query_len=2, max_seq_len=2,
        )
        hidden = self.model(torch.zeros(3, dtype=torch.long, device=dev), torch.tensor([0, 0, 1], device=dev), md,
                            self._dummy_intermediate(3))
        if self.is_last_stage:
            logits = self.model.compute_logits(hidden[1:])
            self.sampler(logits, SamplingMetadata(temperature=torch.tensor([1.0, 0.0], device=dev),
                                                  all_greedy=False, all_random=False))
            # The LM head runs outside the decode graphs, on as many rows as sample: its
            # small-row kernels have one variant for 1 row, one up to 16 and one up to 32.
            for rows in sorted({1, min(17, self.max_num_reqs)}):
                self.model.compute_logits(torch.zeros(rows, hidden.shape[-1], dtype=hidden.dtype, device=dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Capture one graph of the model forward per decode batch size, largest first, in one
        shared memory pool. A decode step then replays the smallest graph that holds it."""
        if self.device.type != "cuda" or not getattr(self.attn_backend, "cuda_graph_safe", False):
            return
        if self.pp_size > 1:
            logger.info("Pipeline parallelism: steps run eagerly (no CUDA graphs)")
            return
        import time

        t0 = time.perf_counter()
        sizes = self.cuda_graph_sizes()
        pool = torch.cuda.graph_pool_handle()
        # Our own capture stream: torch's default one is created once per process, on whichever
        # device was current then, and capturing there would switch this engine to that device.
        stream = torch.cuda.Stream(self.device)
        buf = self._reset_graph_inputs()
        for bs in reversed(sizes):
            md = self._graph_metadata(bs)
            args = (buf.input_ids[:bs], buf.positions[:bs], md)
            self.model(*args)  # warm-up: compiles kernels, settles allocator state
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.model(*args)
            self.cuda_graphs[bs] = (graph, out)
        torch.cuda.synchronize(self.device)
        self._graph_sizes = sizes
        logger.info("Captured %d CUDA graphs for decode batches of 1..%d in %.1f s",
                    len(sizes), sizes[-1], time.perf_counter() - t0)

    def _reset_graph_inputs(self) -> "_DeviceBuffers":
        """The input buffers as graph capture (and its dry run) reads them: one context token
        per request, nothing written to the cache."""
        buf = self._buffers
        buf.input_ids.zero_()
        buf.positions.zero_()
        buf.slot_mapping.fill_(-1)
        buf.seq_lens.fill_(1)
        buf.block_tables.zero_()
        return buf

    # ---- pipeline parallelism ------------------------------------------------------------------
    def _dummy_intermediate(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
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

    def _graph_metadata(self, bs: int) -> AttentionMetadata:
        buf = self._buffers
        return AttentionMetadata(
            num_actual_tokens=bs, slot_mapping=buf.slot_mapping[:bs], block_tables=buf.block_tables[:bs],
            query_start_loc=buf.graph_query_start_loc[:bs + 1], seq_lens=buf.seq_lens[:bs],
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[1] * bs,
            max_query_len=1, max_seq_len=self.config.scheduler_config.max_model_len,
        )

    def _graph_size_for(self, num_reqs: int) -> int | None:
        for size in self._graph_sizes:
            if size >= num_reqs:
                return size
        return None

    # ---- one step ---------------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self._preempted_generators.pop(req_id, None)
            self._drop(req_id)
        for req_id in sched.preempted_req_ids:
            state = self._drop(req_id)
            if state is not None and state.generator is not None:
                self._preempted_generators[req_id] = state.generator
        for new in sched.scheduled_new_reqs:
            self._add_request(new)
        for cached in sched.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.new_block_ids:
                n = len(state.block_ids)
                self.block_table_cpu[state.row, n:n + len(cached.new_block_ids)] = cached.new_block_ids
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_token_ids:  # pipeline parallelism: tokens sampled by the last stage
                pos = max(cached.num_computed_tokens, state.num_prompt_tokens)
                for tok in cached.new_token_ids:
                    if pos == len(state.token_ids):  # the last stage already holds its own
                        self.token_ids_cpu[state.row, pos] = tok
                        state.token_ids.append(tok)
                    pos += 1

    def _drop(self, req_id: str) -> CachedRequestState | None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
        return state

    def _add_request(self, new: NewRequestData) -> None:
        generator = self._preempted_generators.pop(new.req_id, None)  # resumed: same RNG stream
        row = self._free_rows.pop()
        params = new.sampling_params
        if generator is None and params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
        self.token_ids_cpu[row, :len(token_ids)] = token_ids
        self.block_table_cpu[row, :len(new.block_ids)] = new.block_ids
        self.requests[new.req_id] = CachedRequestState(
            req_id=new.req_id, token_ids=token_ids, num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=params, block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
            row=row, generator=generator, features=sampling_features(params),
        )

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput, non_block: bool = False):
        """Run one step. With ``non_block`` the sampled tokens stay in flight: the return is a
        handle whose ``result()`` waits for them, and the next step may be launched first
        (async scheduling: its decodes read their input tokens from the device)."""
        self._update_states(sched)
        req_ids = [c.req_id for c in sched.scheduled_cached_reqs] + [n.req_id for n in sched.scheduled_new_reqs]
        if not req_ids:
            return _PendingOutput.done(ModelRunnerOutput([], [])) if non_block else ModelRunnerOutput([], [])
        if self._pending is not None and self._needs_known_outputs(req_ids):
            self._pending.result()  # penalties / bad words / processors read the exact history
        batch = self._prepare_inputs(req_ids, sched.num_scheduled_tokens)
        if batch.graph_size is not None:
            graph, out = self.cuda_graphs[batch.graph_size]
            graph.replay()
            hidden = out[:len(req_ids)]
        else:
            hidden = self._run_model(batch.input_ids, batch.positions, batch.attn_metadata)
        if not self.is_last_stage:  # the last stage samples; the engine reads its output
            output = ModelRunnerOutput(req_ids, [[] for _ in req_ids])
            return _PendingOutput.done(output) if non_block else output

        sample_rows = batch.sample_rows
        pending = _PendingOutput(self, req_ids, sample_rows)
        if sample_rows:
            states = [self.requests[req_ids[i]] for i in sample_rows]
            last_hidden = hidden[:batch.num_tokens] if batch.sample_index is None else hidden[batch.sample_index]
            logits = self.model.compute_logits(last_hidden)
            out = self.sampler(logits, self._sampling_metadata(states, batch.temperature))
            pending.launch_copy(states, out)
            for state in states:
                state.num_inflight += 1
            self._prev_sampled = out.sampled_token_ids
            self._prev_index = {state.req_id: j for j, state in enumerate(states)}
        pending.prompt_logprobs = self._prompt_logprobs(req_ids, batch, hidden)
        if non_block:
            self._pending = pending
            return pending
        return pending.result()

    def _needs_known_outputs(self, req_ids: list[str]) -> bool:
        return any(s.num_inflight and s.features & _HISTORY_FEATURES for s in map(self.requests.__getitem__, req_ids))

    @dataclass
    class _Batch:
        input_ids: torch.Tensor
        positions: torch.Tensor
        attn_metadata: AttentionMetadata | None  # None when a CUDA graph replays the step
        num_tokens: int
        query_start_loc: list[int]
        starts: list[int]  # num_computed_tokens of each request before this step
        graph_size: int | None  # replay the CUDA graph of this padded batch size
        sample_rows: list[int]  # the rows whose request reaches its last known token this step: they sample
        sample_index: torch.Tensor | None  # their last tokens' rows of the flat batch (None: all, a decode)
        temperature: torch.Tensor | None  # their temperatures, on the device

    def _prepare_inputs(self, req_ids: list[str], num_scheduled: dict[str, int]) -> "_Batch":
        """The flat batch, built with vectorized gathers from the persistent arrays."""
        bs = self.block_size
        states = [self.requests[r] for r in req_ids]
        counts = np.fromiter((num_scheduled[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        starts = [s.num_computed_tokens for s in states]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        num_reqs, total = len(req_ids), int(counts.sum())
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        starts_np = np.asarray(starts, dtype=np.int64)
        seq_lens = starts_np + counts
        if total == num_reqs:  # decode only: one token per request
            token_rows, positions = rows, starts_np
        else:
            token_rows = np.repeat(rows, counts)
            positions = np.repeat(starts_np - qsl[:-1], counts) + np.arange(total)
        input_ids = self.token_ids_cpu[token_rows, positions]
        slots = self.block_table_cpu[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        num_blocks = -(-int(seq_lens.max()) // bs)
        block_tables = self.block_table_cpu[rows, :num_blocks]
        completes = [end == len(s.token_ids) + s.num_inflight for end, s in zip(seq_lens.tolist(), states)]
        # Inputs still in flight (async scheduling): the previous step's samples, on the device.
        inflight = [(int(qsl[i]) + len(s.token_ids) - starts[i], self._prev_index[s.req_id])
                    for i, s in enumerate(states) if s.num_inflight]
        for s, end in zip(states, seq_lens.tolist()):
            s.num_computed_tokens = end

        graph_size = self._graph_size_for(num_reqs) if total == num_reqs else None
        buf = self._buffers
        qsl_list = qsl.tolist()
        buf.begin_step()
        md = None  # a replayed graph reads the same buffers through its captured metadata
        if graph_size is not None:
            n = graph_size
            ids_d = buf.upload("input_ids", input_ids, n, pad=0)
            pos_d = buf.upload("positions", positions, n, pad=0)
            buf.upload("slot_mapping", slots, n, pad=-1)
            buf.upload("seq_lens", seq_lens, n, pad=1)
            buf.upload_block_tables(block_tables)
        else:
            ids_d = buf.upload("input_ids", input_ids)
            pos_d = buf.upload("positions", positions)
            slots_d = buf.upload("slot_mapping", slots)
            seq_d = buf.upload("seq_lens", seq_lens)
            qsl_d = buf.upload("query_start_loc", qsl)
            bt_d = buf.upload_block_tables(block_tables)
            md = AttentionMetadata(
                num_actual_tokens=total, slot_mapping=slots_d, block_tables=bt_d, query_start_loc=qsl_d,
                seq_lens=seq_d, query_start_loc_cpu=qsl_list, seq_lens_cpu=seq_lens.tolist(),
                max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()),
            )
        if inflight:
            dst, src = (buf.upload(name, np.fromiter(x, dtype=np.int64, count=len(inflight)))
                        for name, x in zip(("inflight_dst", "inflight_src"), zip(*inflight)))
            ids_d[dst] = self._prev_sampled[src]
        # What sampling needs on the device goes up with the rest, through the pinned buffers:
        # a copy from pageable memory may wait for the stream, stalling the host while the
        # device drains.
        sample_rows = [i for i, c in enumerate(completes) if c]
        temperature = sample_index = None
        if sample_rows:
            temperature = buf.upload("temperature", np.fromiter(
                (states[i].sampling_params.temperature for i in sample_rows), dtype=np.float32, count=len(sample_rows)))
            if len(sample_rows) != total:
                sample_index = buf.upload("sample_index", qsl[np.asarray(sample_rows) + 1] - 1)
        buf.end_step()
        return self._Batch(ids_d, pos_d, md, total, qsl_list, starts, graph_size, sample_rows, sample_index,
                           temperature)

    def _sampling_metadata(self, states: list[CachedRequestState], temperature: torch.Tensor) -> SamplingMetadata:
        """Per-row sampling settings (``temperature`` already on the device); only what some
        row of this batch uses is built."""
        dev = self.device
        params = [s.sampling_params for s in states]
        temps = [p.temperature for p in params]
        md = SamplingMetadata(
            temperature=temperature,
            all_greedy=all(t == 0.0 for t in temps),
            all_random=all(t != 0.0 for t in temps),
        )
        md.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        features = frozenset().union(*(s.features for s in states))
        if not features:
            return md
        # Output histories are only read by penalties and logits processors.
        if features & {"presence", "frequency", "repetition", "procs"}:
            md.output_token_ids = [s.output_token_ids for s in states]
        if "top_p" in features:
            md.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        if "top_k" in features:
            md.top_k = torch.tensor([min(p.top_k or self.vocab_size, self.vocab_size) for p in params],
                                    dtype=torch.long, device=dev)
        if "min_p" in features:
            md.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        if "logprobs" in features:
            wanted = [p.logprobs for p in params if p.logprobs is not None]
            md.max_num_logprobs = -1 if -1 in wanted else max(wanted)
        if "presence" in features:
            md.presence_penalties = torch.tensor([p.presence_penalty for p in params], device=dev)
        if "frequency" in features:
            md.frequency_penalties = torch.tensor([p.frequency_penalty for p in params], device=dev)
        if "repetition" in features:
            md.repetition_penalties = torch.tensor([p.repetition_penalty for p in params], device=dev)
            md.prompt_token_ids = self._padded_prompts(states)
        if "allowed" in features:
            mask = torch.zeros(len(states), self.vocab_size, dtype=torch.bool)
            for i, p in enumerate(params):
                if p.allowed_token_ids:
                    mask[i] = True
                    mask[i, p.allowed_token_ids] = False
            md.allowed_token_ids_mask = mask.to(dev)
        if features & {"bias", "ban", "procs"}:
            for i, (s, p) in enumerate(zip(states, params)):
                if p.logit_bias:
                    md.logit_bias[i] = {int(k): float(v) for k, v in p.logit_bias.items()}
                if "ban" in s.features:
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
            banned.extend(p.all_stop_token_ids)
        for word in p.bad_words_token_ids:
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


class _DeviceBuffers:
    """Fixed device tensors for one step's inputs, fed from pinned host staging buffers.

    A step costs one host-to-device copy per array, and CUDA graphs replay over the same
    addresses. On CPU the arrays are used in place (no copies at all).
    """

    _DTYPES = {"input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
               "seq_lens": torch.int32, "query_start_loc": torch.int32, "temperature": torch.float32,
               "sample_index": torch.int64, "inflight_dst": torch.int64, "inflight_src": torch.int64}

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device) -> None:
        self.device = device
        self.on_cpu = device.type == "cpu"
        sizes = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                 "seq_lens": max_reqs, "query_start_loc": max_reqs + 1, "temperature": max_reqs,
                 "sample_index": max_reqs, "inflight_dst": max_reqs, "inflight_src": max_reqs}
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        if self.on_cpu:
            return
        for name, size in sizes.items():
            self.host[name] = torch.zeros(size, dtype=self._DTYPES[name], pin_memory=True)
            self.dev[name] = torch.zeros(size, dtype=self._DTYPES[name], device=device)
        self.host["block_tables"] = torch.zeros(max_reqs * max_blocks, dtype=torch.int32, pin_memory=True)
        self.dev["block_tables"] = torch.zeros(max_reqs, max_blocks, dtype=torch.int32, device=device)
        self.graph_query_start_loc = torch.arange(max_reqs + 1, dtype=torch.int32, device=device)
        # The pinned buffers are rewritten each step: wait until the last step's copies ran.
        self._copied = torch.cuda.Event()
        self._pending = False

    def __getattr__(self, name: str) -> torch.Tensor:  # buf.input_ids etc.: the device tensors
        dev = self.__dict__.get("dev", {})
        if name in dev:
            return dev[name]
        raise AttributeError(name)

    def begin_step(self) -> None:
        if not self.on_cpu and self._pending:
            self._copied.synchronize()

    def end_step(self) -> None:
        if not self.on_cpu:
            self._copied.record()
            self._pending = True

    def upload(self, name: str, values: np.ndarray, size: int | None = None, pad: int = 0) -> torch.Tensor:
        """``values`` (padded with ``pad`` up to ``size``) on the device, as a view of the buffer."""
        dtype = self._DTYPES[name]
        n = len(values)
        if self.on_cpu:
            t = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
            if size is not None and size > n:
                t = torch.cat([t, torch.full((size - n,), pad, dtype=dtype)])
            return t
        size = n if size is None else size
        host = self.host[name]
        host.numpy()[:n] = values
        if size > n:
            host[n:size] = pad
        dev = self.dev[name][:size]
        dev.copy_(host[:size], non_blocking=True)
        return dev

    def upload_block_tables(self, table: np.ndarray) -> torch.Tensor:
        rows, cols = table.shape
        if self.on_cpu:
            return torch.from_numpy(np.ascontiguousarray(table))
        host = self.host["block_tables"][:rows * cols]
        host.numpy().reshape(rows, cols)[:] = table
        dev = self.dev["block_tables"][:rows, :cols]
        dev.copy_(host.view(rows, cols), non_blocking=True)
        return dev


class _PendingOutput:
    """One step's ModelRunnerOutput, its sampled tokens possibly still being copied to the host."""

    def __init__(self, runner: "ModelRunner", req_ids: list[str], sample_rows: list[int]) -> None:
        self.runner, self.req_ids, self.sample_rows = runner, req_ids, sample_rows
        self.states: list[CachedRequestState] = []
        self.sampler_output = None
        self.host_tokens: torch.Tensor | None = None
        self.event = None
        self.prompt_logprobs: dict[str, list[PositionLogprobs]] = {}
        self._result: ModelRunnerOutput | None = None

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> "_PendingOutput":
        pending = cls(None, output.req_ids, [])
        pending._result = output
        return pending

    def launch_copy(self, states: list[CachedRequestState], out) -> None:
        runner = self.runner
        self.states, self.sampler_output = states, out
        n = len(states)
        if runner.device.type == "cuda":
            runner._sampled_host_turn ^= 1
            self.host_tokens = runner._sampled_host[runner._sampled_host_turn][:n]
            self.host_tokens.copy_(out.sampled_token_ids, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host_tokens = out.sampled_token_ids

    def result(self) -> ModelRunnerOutput:
        """Wait for the tokens, append them to the runner's request states (once)."""
        if self._result is not None:
            return self._result
        runner = self.runner
        sampled_lists: list[list[int]] = [[] for _ in self.req_ids]
        logprobs: dict[str, PositionLogprobs] = {}
        if self.states:
            if self.event is not None:
                self.event.synchronize()
            tokens = self.host_tokens.tolist()
            out = self.sampler_output
            if out.logprobs is not None:
                lp_ids, lps, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist()
            for j, (row, state) in enumerate(zip(self.sample_rows, self.states)):
                tok = tokens[j]
                if runner.requests.get(state.req_id) is state:  # not finished/preempted since
                    runner.token_ids_cpu[state.row, len(state.token_ids)] = tok
                    state.token_ids.append(tok)
                    state.num_inflight -= 1
                sampled_lists[row] = [tok]
                k = state.sampling_params.logprobs
                if k is not None:
                    n = len(lp_ids[j]) if k < 0 else 1 + k
                    logprobs[state.req_id] = (lp_ids[j][:n], lps[j][:n], ranks[j][:n])
        if runner is not None and runner._pending is self:
            runner._pending = None
        self._result = ModelRunnerOutput(self.req_ids, sampled_lists, logprobs, self.prompt_logprobs)
        self.runner = self.states = self.sampler_output = None
        return self._result
