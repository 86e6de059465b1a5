"""CUDA graphs of decode steps, and the start-up forwards around them (kernel warm-up, compile dry run).

A pure-decode step of up to ``max_num_seqs`` requests replays the graph of the smallest
captured batch size that holds it, its inputs padded in the fixed device buffers (padding
rows write to no slot: slot -1). Graphs are captured largest first, in one memory pool.

``profile_run``, ``warm_up_kernels`` and ``compile_dry_run`` take the ModelRunner: they are
start-up forwards of its model (the memory profile, and the kernel variants that steps later
need), on scratch inputs that leave its KV cache alone.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import nn

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.model.moe import FusedMoE
from pagedllm.ops.tile_tables import DECODE_ROW_BUCKETS
from pagedllm.sample.sampler import SamplingMetadata
from pagedllm.worker.device_buffers import DeviceBuffers
from pagedllm.worker.piecewise_graphs import PiecewiseGraphs, capture_sets

logger = logging.getLogger("pagedllm")


def cuda_graph_sizes(max_num_reqs: int, max_num_tokens: int) -> list[int]:
    """The padded batch sizes captured: 1, 2, 4, 8, then every 16 up to max_num_seqs (or
    the token budget, if smaller), which is always one."""
    limit = min(max_num_reqs, max_num_tokens)
    sizes = [b for b in (1, 2, 4, 8) if b < limit] + list(range(16, limit, 16)) + [limit]
    return sorted(set(sizes))


# Speculative steps (every request verifying k drafts: 1 + k tokens each) are captured up to
# this many requests: speculation pays at small batches (disable_by_batch_size).
MAX_SPEC_GRAPH_REQS = 64


class CudaGraphs:
    """The decode graphs of one runner (or of its draft model), by padded batch size, over the
    runner's device buffers. With speculative decoding (k drafts at most) more sets hold steps
    of q = 2 .. 1 + k tokens per request: the shape of a step where every request verifies
    q - 1 drafts (n-gram proposals may be shorter than k). ``decodes=False`` (pooling runners:
    every step they run is prompts, which the piecewise graphs serve) captures no decode graphs."""

    def __init__(self, buffers: DeviceBuffers, device: torch.device, graph_safe: bool, pp_size: int,
                 max_num_reqs: int, max_num_tokens: int, max_model_len: int, max_spec_q: int | None = None,
                 decodes: bool = True) -> None:
        self.buffers = buffers
        self.device = device
        self.graph_safe = graph_safe  # the attention backend can be captured
        self.pp_size = pp_size
        self.max_model_len = max_model_len
        self.candidate_sizes = cuda_graph_sizes(max_num_reqs, max_num_tokens) if decodes else []
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sizes: list[int] = []  # captured sizes, ascending (empty: every step runs eagerly)
        # With LoRA: a second set whose adapters map through the LoRA manager's fixed buffers.
        self.lora_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.max_spec_q = max_spec_q
        self.spec_qs = [] if max_spec_q is None else list(range(2, max_spec_q + 1))
        self.spec_candidate_sizes = {q: cuda_graph_sizes(min(max_num_reqs, MAX_SPEC_GRAPH_REQS), max_num_tokens // q)
                                     for q in self.spec_qs}
        self.spec_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (q, size)
        self.spec_sizes: dict[int, list[int]] = {}
        self._spec_qsl: dict[int, torch.Tensor] = {}  # 0, q, 2q, ...: the captured query starts
        self.piecewise: PiecewiseGraphs | None = None  # steps with prefill chunks (the runner sets it)

    def size_for(self, num_reqs: int, lora: bool = False, q: int = 1) -> int | None:
        """The captured batch size a step of ``num_reqs`` requests of ``q`` tokens each replays
        (None: run eagerly)."""
        if q != 1:
            if lora or q not in self.spec_sizes:
                return None
            sizes = self.spec_sizes[q]
        elif lora and not self.lora_graphs:
            return None
        else:
            sizes = self.sizes
        i = bisect.bisect_left(sizes, num_reqs)
        return sizes[i] if i < len(sizes) else None

    def piece_size(self, num_tokens: int, eager: bool, lora: bool = False) -> int | None:
        """The padded token count whose piecewise graphs a step with prefill chunks replays
        (None: it runs eagerly; ``eager``: it must; ``lora``: it runs adapters)."""
        return None if eager or self.piecewise is None else self.piecewise.size_for(num_tokens, lora)

    def replay(self, size: int, num_tokens: int, lora: bool = False, q: int = 1) -> torch.Tensor:
        """Replay the graph of ``size`` requests (of ``q`` tokens each) over the buffers as
        uploaded; the first ``num_tokens`` rows of its output are the step's hidden states."""
        graph, out = self.spec_graphs[q, size] if q != 1 else (self.lora_graphs if lora else self.graphs)[size]
        graph.replay()
        return out[:num_tokens]

    def metadata(self, bs: int, q: int = 1) -> AttentionMetadata:
        """The attention metadata a graph of ``bs`` requests of ``q`` tokens each captures:
        views of the buffers."""
        buf = self.buffers
        n = bs * q
        qsl = buf.graph_query_start_loc if q == 1 else self._spec_qsl[q]
        md = AttentionMetadata(
            num_actual_tokens=n, slot_mapping=buf.slot_mapping[:n], block_tables=buf.block_tables[:bs],
            query_start_loc=qsl[:bs + 1], seq_lens=buf.seq_lens[:bs],
            query_start_loc_cpu=list(range(0, n + 1, q)), seq_lens_cpu=[q] * bs,
            max_query_len=q, max_seq_len=self.max_model_len,
        )
        if buf.num_kv_groups > 1:  # each further group's table and slots, from its own buffers
            md.with_groups([(buf.block_tables_of(g)[:bs], buf.dev[f"slot_mapping_{g}"][:n])
                            for g in range(1, buf.num_kv_groups)])
        return md

    def reset_inputs(self, q: int = 1) -> DeviceBuffers:
        """The input buffers as graph capture (and its dry run) reads them: ``q`` context
        tokens per request, nothing written to the cache."""
        buf = self.buffers
        buf.input_ids.zero_()
        buf.positions.zero_()
        buf.slot_mapping.fill_(-1)
        buf.seq_lens.fill_(q)
        for g in range(buf.num_kv_groups):
            buf.block_tables_of(g).zero_()
            if g:
                buf.dev[f"slot_mapping_{g}"].fill_(-1)
        return buf

    @torch.inference_mode()
    def capture(self, model: nn.Module, lora=None) -> None:
        """Capture one graph of the model forward per decode batch size, largest first, in one
        shared memory pool. A decode step then replays the smallest graph that holds it.

        Only the largest size of each set of graphs (and of the piecewise sizes) runs an eager
        warm-up forward before its capture. The others are captured directly: their memory comes
        from the graphs' pool either way, and a Triton kernel variant first met inside a capture
        loads (or compiles) there as it would outside (``tests/gpu/test_precompile.py`` starts with
        an empty Triton cache and no compile pool). A warm-up per size cost ~1 s of start-up for
        the llama3-8b shape on an H200 (capture 2.0 -> 1.4 s, qwen3-0.6b 2.3 -> 1.2 s)."""
        if self.device.type != "cuda" or not self.graph_safe:
            return
        if self.pp_size > 1:
            logger.info("Pipeline parallelism: steps run eagerly (no CUDA graphs)")
            return
        t0 = time.perf_counter()
        sizes = self.candidate_sizes
        pool = torch.cuda.graph_pool_handle()
        # Our own capture stream: torch's default one is created once per process, on whichever
        # device was current then, and capturing there would switch this engine to that device.
        stream = torch.cuda.Stream(self.device)
        lora = lora if lora is not None and lora.graphs_supported() else None
        if lora is not None:  # the token-to-slot buffers hold the largest graph's tokens
            lora.max_graph_tokens = max(sizes[-1] if sizes else 0,
                                        self.piecewise.candidate_sizes[-1] if self.piecewise else 0)
        if self.piecewise is not None:
            self.piecewise.capture(model, pool, stream, lora)
        buf = self.reset_inputs()
        capture_sets(self.graphs, self.lora_graphs, lora, sizes,
                     lambda bs, warm_up: self._capture_one(model, buf, bs, 1, pool, stream, warm_up))
        for q in reversed(self.spec_qs):  # speculative steps: q tokens per request
            candidates = self.spec_candidate_sizes[q]
            self._spec_qsl[q] = torch.arange(0, (candidates[-1] + 1) * q, q, dtype=torch.int32, device=self.device)
            buf = self.reset_inputs(q)
            for bs in reversed(candidates):
                self.spec_graphs[q, bs] = self._capture_one(model, buf, bs, q, pool, stream,
                                                            warm_up=bs == candidates[-1])
            self.reset_inputs()
        torch.cuda.synchronize(self.device)
        self.sizes = list(sizes)
        self.spec_sizes = {q: list(c) for q, c in self.spec_candidate_sizes.items()}
        spec = f", and of 2..{self.spec_qs[-1]} tokens per request for 1..{self.spec_candidate_sizes[2][-1]}" \
            if self.spec_qs else ""
        pieces = f"; steps with prefill chunks in pieces at {len(self.piecewise.sizes)} sizes up to " \
            f"{self.piecewise.sizes[-1]} tokens" if self.piecewise is not None and self.piecewise.sizes else ""
        logger.info("Captured %d CUDA graphs for decode batches of %s%s%s%s in %.1f s",
                    len(self.graphs) + len(self.lora_graphs) + len(self.spec_graphs),
                    f"1..{sizes[-1]}" if sizes else "no size (prompts only)",
                    " (with and without LoRA)" if self.lora_graphs else "", spec, pieces, time.perf_counter() - t0)

    def _capture_one(self, model: nn.Module, buf: DeviceBuffers, bs: int, q: int, pool,
                     stream: torch.cuda.Stream, warm_up: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of one forward over ``bs`` requests of ``q`` tokens each, and its output.
        ``warm_up``: run the forward eagerly first (the largest size of a set does; see
        ``capture``)."""
        args = (buf.input_ids[:bs * q], buf.positions[:bs * q], self.metadata(bs, q))
        if warm_up:
            model(*args)
            torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # Not ``torch.cuda.graph()``: it empties the allocator's device and pinned-host caches
        # before every capture, and the first one released the blocks that the KV sizing's last
        # forward leaves cached for the first long prefills (capture's wall time did not change
        # measurably on an H100). The captured forward draws from ``pool`` either way.
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                out = model(*args)
            finally:
                graph.capture_end()
        return graph, out

    def release(self) -> None:
        """Forget the captured graphs (and their memory pool); steps run eagerly until
        ``capture`` runs again."""
        self.graphs = {}
        self.lora_graphs = {}
        self.sizes = []
        self.spec_graphs = {}
        self.spec_sizes = {}
        if self.piecewise is not None:
            self.piecewise.release()


@torch.inference_mode()
def profile_run(runner, num_tokens: int) -> None:
    """One forward + sample at the largest step size, to measure peak activation memory."""
    dev, model = runner.device, runner.model
    num_blocks = -(-num_tokens // runner.block_size)
    # No sequence of a step is longer than max_model_len (position tables may end there: rotary
    # caches, absolute positions of pooling models): the tokens go in sequences of at most that.
    longest = min(num_tokens, runner.config.scheduler_config.max_model_len)
    lens = [longest] * (num_tokens // longest) + ([num_tokens % longest] if num_tokens % longest else [])
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    blocks_each = -(-longest // runner.block_size)
    with runner.scratch_kv_cache(max(num_blocks, blocks_each * len(lens))):
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        md = AttentionMetadata(
            num_actual_tokens=num_tokens, slot_mapping=torch.cat(
                [torch.arange(n, device=dev) + i * blocks_each * runner.block_size for i, n in enumerate(lens)]),
            block_tables=torch.arange(blocks_each * len(lens), dtype=torch.int32, device=dev).view(len(lens), -1),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=lens, max_query_len=max(lens), max_seq_len=max(lens),
        )
        hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=dev), positions, md,
                       runner.dummy_intermediate(num_tokens))
        if not runner.is_last_stage:
            return
        num_rows = min(runner.max_num_reqs, num_tokens)
        if runner.pooling is not None:  # no logits: the head of as many pooled rows as a step can end
            if runner.pooling.pooler.kind != "embed":
                model.classify(hidden[:num_rows])
            return
        logits = model.compute_logits(hidden[:num_rows])
        runner.sampler(logits, SamplingMetadata(
            temperature=torch.ones(num_rows, device=dev), all_greedy=False, all_random=True,
            top_p=torch.full((num_rows,), 0.9, device=dev)))


@torch.inference_mode()
def warm_up_kernels(runner) -> None:
    """Compile, at start-up, the kernel variants that neither the profiling forward (one
    long prefill) nor graph capture (pure decodes) reach: a mixed step of a decode and a
    two-token chunk, the one-pass sampler, and the LM head's small-row GEMMs. Otherwise
    the first such step of a run pays Triton's compile time; and the fused-MoE kernels at the
    tiles of every batch size. Nothing is written to the KV cache (slots are -1)."""
    dev, model = runner.device, runner.model
    hidden = model(torch.zeros(3, dtype=torch.long, device=dev), torch.tensor([0, 0, 1], device=dev),
                   _dry_metadata(runner, [1, 2], [1, 2]), runner.dummy_intermediate(3))
    if runner.pooling is None:  # pooling runs prompts only: no decode rides beside a chunk
        # A decode over 2,048 keys beside a 17-token chunk (longer than any short run): the split launch
        # of a mixed step's decodes and its merge (triton_kernels._mixed_splits).
        model(torch.zeros(18, dtype=torch.long, device=dev), torch.arange(18, device=dev),
              _dry_metadata(runner, [1, 17], [2048, 17]), runner.dummy_intermediate(18))
    kernel_shapes = set()  # the fused-MoE kernels at every batch bucket's tiles: prefill sizes too
    for module in model.modules():
        if isinstance(module, FusedMoE) and module.kernel_shape() not in kernel_shapes:
            kernel_shapes.add(module.kernel_shape())
            module.warm_up_kernels(runner.config.scheduler_config.max_num_batched_tokens)
    if runner.is_last_stage and runner.pooling is not None:
        if runner.pooling.pooler.kind != "embed":
            model.classify(hidden[1:])
    elif runner.is_last_stage:
        logits = model.compute_logits(hidden[1:])
        runner.sampler(logits, SamplingMetadata(temperature=torch.tensor([1.0, 0.0], device=dev),
                                                all_greedy=False, all_random=False))
        # The LM head runs outside the decode graphs, on as many rows as sample: its small-row
        # GEMM takes a tiling per row bucket (the tuned table's), each its own kernel variant.
        for rows in sorted({min(bucket, runner.max_num_reqs) for bucket in DECODE_ROW_BUCKETS}):
            model.compute_logits(torch.zeros(rows, hidden.shape[-1], dtype=hidden.dtype, device=dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _dry_metadata(runner, q_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    """A start-up forward's metadata: runs of ``q_lens`` query tokens, the last of ``seq_lens``
    tokens each, whose every key is block 0's; no slot is written (-1)."""
    dev = runner.device
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        num_actual_tokens=qsl[-1], slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=dev),
        block_tables=torch.zeros(len(q_lens), -(-max(seq_lens) // runner.block_size), dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
    )


@torch.inference_mode()
def compile_dry_run(runner) -> None:
    """Start-up's forwards in miniature, for ``pagedllm.ops.precompile`` to see which Triton
    kernels they compile (its hook skips those launches): the profiling forward (at a
    token count that Triton specializes alike: a multiple of 16 or not), the warm-up step,
    and a decode forward at every graph size, as capture runs them (the launch choices change
    at sizes that depend on the model: split-KV attention below one program per SM, wide
    decode tiles from 128 rows, the small-row GEMMs' row tiles; covering only sizes up to 32
    and the largest missed the unsplit 32-key decode tiles of a model with 2 K/V heads). A warm
    start-up reads the jobs an earlier one kept instead (``precompile.jobs_file``), so this
    runs on a start-up that compiles anyway. Reads and writes only a 4-block scratch KV cache."""
    n = runner.config.scheduler_config.max_num_batched_tokens
    profile_run(runner, n if n <= 80 else 64 if n % 16 == 0 else 65)
    graphs: CudaGraphs = runner.graphs
    with runner.scratch_kv_cache(4):
        warm_up_kernels(runner)
        if runner.config.model_config.enforce_eager or graphs.pp_size > 1 or not graphs.graph_safe:
            return
        buf = graphs.reset_inputs()
        sizes = graphs.candidate_sizes
        for bs in sizes:
            runner.model(buf.input_ids[:bs], buf.positions[:bs], graphs.metadata(bs))
        if graphs.piecewise is not None:  # and the padded token counts of steps with prefill chunks
            for n in graphs.piecewise.candidate_sizes:
                runner.model(buf.input_ids[:n], buf.positions[:n], graphs.piecewise.warm_up_metadata(n))
