"""Speculative decoding with a draft model: a smaller model of the same vocabulary guesses each
request's next k tokens; the target verifies them in its next step (sample/rejection.py).

The draft keeps its own paged KV cache (its layers' shapes, the same blocks: one block table
serves both). It runs on the target's own inputs, so its cache holds the same positions
(prompts, chunks, verified drafts; rejected positions are written over later, as the target's
are); a step where every request verifies drafts it skips, its guessing decodes having written
those positions already (``follow``). After the step's tokens are known, it decodes k greedy
steps from each request's last token into the lookahead slots the scheduler allocated (a
point-mass proposal: the verification rule keeps the target's distribution whatever the draft
says).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backend import AttentionMetadata, kv_cache_shape
from pagedllm.distributed.parallel_state import get_tp_size, replicated
from pagedllm.sample.draw import greedy
from pagedllm.worker.cuda_graphs import CudaGraphs
from pagedllm.worker.kv_cache import zeroed_cache

if TYPE_CHECKING:
    from pagedllm.worker.input_batch import CachedRequestState
    from pagedllm.worker.model_runner import ModelRunner, _Batch


def draft_scope(config) -> contextlib.AbstractContextManager:
    """Where the draft is built and run: under tensor parallelism with
    ``draft_tensor_parallel_size=1`` every rank holds and runs the whole draft, its collectives
    off (the ranks compute the same guesses; the driver's reach the scheduler)."""
    spec = config.speculative_config
    alone = spec is not None and spec.draft_tensor_parallel_size == 1 and get_tp_size() > 1
    return replicated() if alone else contextlib.nullcontext()


class DraftModel:
    # The draft's own CUDA graphs (over the runner's device buffers): its k guessing decodes and
    # its run over a speculative step's 1 + k tokens per request replay them like the target's.
    uses_graphs = True

    def __init__(self, runner: "ModelRunner", model: nn.Module, num_speculative_tokens: int) -> None:
        self.runner, self.model, self.k = runner, model, num_speculative_tokens
        self.attn_layers = [m for m in model.modules() if hasattr(m, "kv_cache") and hasattr(m, "attn_backend")]
        for layer in self.attn_layers:
            layer.attn_backend = runner.attn_backend
        g = runner.graphs
        self.graphs = CudaGraphs(runner._buffers, g.device, g.graph_safe, g.pp_size, runner.max_num_reqs,
                                 runner.max_num_tokens, g.max_model_len, max_spec_q=g.max_spec_q) \
            if self.uses_graphs else None
        self._catch_up = False  # the last step skipped follow: the first guess reads two tokens

    def capture_cuda_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.capture(self.model)

    def release_cuda_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()

    def _shape(self, layer: nn.Module, num_blocks: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, self.runner.block_size, layer.num_kv_heads, layer.head_dim)

    def bytes_per_block(self) -> int:
        return sum(int(np.prod(self._shape(layer, 1))) for layer in self.attn_layers) * self.runner.kv_dtype.itemsize

    def allocate(self, num_blocks: int) -> None:
        for layer in self.attn_layers:
            layer.kv_cache = zeroed_cache(self._shape(layer, num_blocks), self.runner.kv_dtype, self.runner.device)

    def free(self) -> None:
        for layer in self.attn_layers:
            layer.kv_cache = None

    @torch.inference_mode()
    def follow(self, batch: "_Batch", hidden: torch.Tensor | None = None) -> None:
        """Run the draft on the step's inputs: its cache gets the same positions as the target's
        (``hidden``, the target's output, is for proposers that read it: worker/spec_eagle.py).

        A step where every request verifies drafts is skipped: the draft's own guessing decodes
        already wrote each draft but the last at its position, and ``propose`` catches up with the
        last two tokens (the last accepted one, whose position may be the one the decodes did
        not reach, and the new one). The draft then runs k forwards per step, not k + 1."""
        nd = batch.num_drafts
        self._catch_up = nd is not None and len(nd) == len(batch.starts) and all(k > 0 for k in nd)
        if self._catch_up:
            return
        md = batch.attn_metadata
        if md is None:  # the target replayed a graph: the same inputs sit in the buffers
            if self.graphs is not None and self.graphs.size_for(batch.graph_size, q=batch.graph_q) == batch.graph_size:
                self.graphs.replay(batch.graph_size, batch.num_tokens, q=batch.graph_q)
                return
            md = self.runner.graphs.metadata(batch.graph_size, batch.graph_q)
        self.model(batch.input_ids, batch.positions, md)

    def after_step(self, output):
        """The step's ModelRunnerOutput, with the draft's guesses for the requests that sampled."""
        states = [self.runner.requests[r] for r, tokens in zip(output.req_ids, output.sampled_token_ids)
                  if tokens and r in self.runner.requests]
        output.spec_token_ids = self.propose(states)
        return output

    @torch.inference_mode()
    def propose(self, states: list["CachedRequestState"]) -> dict[str, list[int]]:
        """k greedy guesses after each request's last (just landed) token. The first forward
        reads the last ``q`` tokens of each request (two after a skipped ``follow``), the others
        one guess each."""
        runner = self.runner
        if not states:
            return {}
        max_len = runner.config.scheduler_config.max_model_len
        q = 2 if self._catch_up else 1
        rows = runner.input_batch.rows_of(states)
        first = np.array([len(s.token_ids) - 1 for s in states], dtype=np.int64)  # the last token's position
        room = np.minimum(self.k, max_len - 1 - first)
        tokens = np.array([s.token_ids[-q:] for s in states], dtype=np.int64)  # [requests, q]
        sizes = None if self.graphs is None else (self.graphs.size_for(len(states), q=q), self.graphs.size_for(len(states)))
        if sizes is not None and None not in sizes and (room >= self.k).all():
            guesses = self._chained_graph_decodes(sizes, rows, tokens, first)
            return {s.req_id: g.tolist() for s, g in zip(states, guesses)}
        drafts: list[list[int]] = [[] for _ in states]
        for j in range(self.k):
            active = np.flatnonzero(room > j)
            if not len(active):
                break
            last = first[active] + j
            step_tokens = tokens[active] if j == 0 else tokens[active, -1:]
            size = None if self.graphs is None else self.graphs.size_for(len(active), q=step_tokens.shape[1])
            if size is not None:
                hidden = self._replay(size, rows[active], step_tokens, last)
            else:
                hidden = self._run_eager(rows[active], step_tokens, last)
            guesses = greedy(self.model.compute_logits(hidden)).cpu().numpy()
            for i, t in zip(active.tolist(), guesses.tolist()):
                drafts[i].append(t)
            tokens[active, -1] = guesses
        return {s.req_id: d for s, d in zip(states, drafts) if d}

    def _chained_graph_decodes(self, sizes: tuple[int, int], rows: np.ndarray, tokens: np.ndarray,
                               first: np.ndarray) -> np.ndarray:
        """All k guessing forwards queued at once, [requests, k] (``sizes``: the graphs of the
        first forward and of the others): each step's guesses are copied on the device into the
        next step's input ids, so the host waits once, for all k, and prepares step j + 1 while
        the device runs step j (a host round trip per guess left the device idle between the
        draft's steps)."""
        n = len(rows)
        guesses = torch.empty(self.k, n, dtype=torch.int64, device=self.runner.device)
        for j in range(self.k):
            step_tokens = tokens if j == 0 else tokens[:, -1:]
            hidden = self._replay(sizes[j > 0], rows, step_tokens, first + j, guesses[j - 1] if j else None)
            guesses[j] = greedy(self.model.compute_logits(hidden))
        return guesses.t().cpu().numpy()

    def _inputs(self, rows: np.ndarray, tokens: np.ndarray, last: np.ndarray):
        """Flat ids and positions of ``tokens`` ([requests, q], ending at positions ``last``),
        each token's request row, and each request's sequence length."""
        q = tokens.shape[1]
        positions = (last[:, None] - np.arange(q - 1, -1, -1)).reshape(-1)
        return tokens.reshape(-1), positions, np.repeat(rows, q), last + 1

    def _replay(self, size: int, rows: np.ndarray, tokens: np.ndarray, last: np.ndarray,
                device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One guessing forward through the draft's graph of ``size``, the hidden state of each
        request's last token: the inputs go into the runner's buffers (the target's step has
        landed: they are free); ``device_tokens``, if given, replace the last tokens' ids (the
        previous guesses, still on the device)."""
        runner, bs, q = self.runner, self.runner.block_size, tokens.shape[1]
        ids, positions, token_rows, seq_lens = self._inputs(rows, tokens, last)
        tables = runner.input_batch.step_tables(rows, token_rows, positions, -(-int(seq_lens.max()) // bs), bs)
        runner._buffers.begin_step()
        ids_d, _ = runner.upload_graph_inputs(ids, positions, seq_lens, tables, size, q)
        runner._buffers.end_step()
        if device_tokens is not None:
            ids_d[q - 1:len(rows) * q:q].copy_(device_tokens)
        return self.graphs.replay(size, len(rows) * q, q=q)[q - 1::q]

    def _run_eager(self, rows: np.ndarray, tokens: np.ndarray, last: np.ndarray) -> torch.Tensor:
        """One guessing forward without graphs; the hidden state of each request's last token."""
        runner, bs, device = self.runner, self.runner.block_size, self.runner.device
        n, q = tokens.shape
        ids, positions, token_rows, seq_lens = self._inputs(rows, tokens, last)
        table = runner.input_batch.block_table_cpu
        slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        num_blocks = -(-int(seq_lens.max()) // bs)
        qsl = np.arange(n + 1, dtype=np.int64) * q

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        md = AttentionMetadata(
            num_actual_tokens=n * q, slot_mapping=dev(slots, torch.int64),
            block_tables=dev(table[rows, :num_blocks], torch.int32), query_start_loc=dev(qsl, torch.int32),
            seq_lens=dev(seq_lens, torch.int32), query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
            max_query_len=q, max_seq_len=int(seq_lens.max()))
        return self.model(dev(ids, torch.int64), dev(positions, torch.int64), md)[q - 1::q]
