"""Speculative decoding with an EAGLE-1 head (model/eagle.py) or an EAGLE-3 head (model/eagle3.py):
one decoder layer fed the target's hidden states guesses each request's next k tokens; the target
verifies them (sample/rejection.py).

The head's KV lives beside the target's, block for block (DraftModel's machinery: its one layer,
the same block tables). Its row at position p reads token p + 1 and the target's feature at p, so
it can only be written once token p + 1 is known: after each step's tokens land, the head runs
over every position the target computed and kept in that step (prompt chunks, decodes, the
accepted part of verified drafts), its next tokens read from the request's row (a prompt's next
token, or the ones the step emitted). A request that sampled then gets its first guess from that
pass's last row, and k - 1 more from single-token steps into the lookahead slots the scheduler
allocated (written over by the next catch-up, as rejected target positions are). Preemption
recomputes the target's positions, and with them the head's. A prefix-cache hit reuses the
head's rows of the cached blocks as the target's; the last row of each such block read the token
after the block in the request that filled it, which may differ: a worse guess, never a wrong
output (verification is exact).

EAGLE-3 differs in what the head reads and says: its rows over the target's positions read the fc
fusion of three of the target's residual streams (captured by the target's LlamaModel into one
static buffer while this proposer exists), its single-token steps read its own previous output
(before its final norm), and its guesses, the argmax of its draft vocabulary, map to target ids
through ``d2t``. Proposals are point masses on those target ids (sample/rejection.py), so a target
token outside the draft vocabulary is never proposed: its draft probability is 0.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.model.eagle3 import aux_layer_ids
from pagedllm.sample.draw import greedy
from pagedllm.worker.spec_draft import DraftModel

if TYPE_CHECKING:
    from pagedllm.core.sched_output import ModelRunnerOutput
    from pagedllm.worker.model_runner import _Batch


class EagleProposer(DraftModel):
    """``follow`` keeps the step's target hidden states; ``after_step`` catches the head up on
    the step's positions and proposes."""

    uses_graphs = False  # the head runs eagerly (its inputs are the target's hidden states)
    _step: "tuple[_Batch, torch.Tensor] | None" = None

    def follow(self, batch: "_Batch", hidden: torch.Tensor) -> None:
        self._step = (batch, hidden)

    def after_step(self, output: "ModelRunnerOutput") -> "ModelRunnerOutput":
        (batch, hidden), self._step = self._step, None
        output.spec_token_ids = self.propose_after(batch, hidden, output)
        return output

    @torch.inference_mode()
    def propose_after(self, batch: "_Batch", hidden: torch.Tensor, output: "ModelRunnerOutput") -> dict[str, list[int]]:
        runner = self.runner
        states = [runner.requests[r] for r in output.req_ids]  # the step's order: the batch's
        rows = runner.input_batch.rows_of(states)
        starts = np.asarray(batch.starts, dtype=np.int64)
        qsl = np.asarray(batch.query_start_loc, dtype=np.int64)
        lens = np.array([len(s.token_ids) for s in states], dtype=np.int64)
        # The positions computed and kept this step whose next token is known (rejected drafts drop out).
        valid = np.maximum(np.minimum(np.diff(qsl), lens - 1 - starts), 0)
        keep = np.flatnonzero(valid)
        if not len(keep):
            return {}
        counts = valid[keep]
        src = np.repeat(qsl[keep], counts) + _ranges(counts)
        positions = np.repeat(starts[keep], counts) + _ranges(counts)
        token_rows = np.repeat(rows[keep], counts)
        ids = runner.input_batch.token_ids_cpu[token_rows, positions + 1]
        md = self._metadata(rows[keep], positions, counts)
        # FP8 KV with calculate_kv_scales: the head's layer sets its scales on the target's first step.
        md.calculate_kv_scales = batch.attn_metadata is not None and batch.attn_metadata.calculate_kv_scales
        features = self._run(ids, self._target_features(hidden, torch.from_numpy(src).to(hidden.device)), positions, md)
        # Requests that sampled: their first guess reads the pass's last row.
        last_row = np.cumsum(counts) - 1
        proposing = [j for j, i in enumerate(keep.tolist()) if output.sampled_token_ids[i]]
        if not proposing:
            return {}
        which = keep[proposing]
        first = lens[which] - 1  # the last token's position: the target computes it next step
        room = np.minimum(self.k, runner.config.scheduler_config.max_model_len - 1 - first)
        feats = features[torch.from_numpy(last_row[proposing]).to(features.device)]
        return self._decode([states[i] for i in which.tolist()], rows[which], first, room, feats)

    def _decode(self, states, rows: np.ndarray, first: np.ndarray, room: np.ndarray,
                feats: torch.Tensor) -> dict[str, list[int]]:
        """Guess 1 from ``feats``; guess j + 1 from the head's step at position first + j - 1."""
        drafts: list[list[int]] = [[] for _ in states]
        active = np.flatnonzero(room > 0)
        tokens = np.zeros(len(states), dtype=np.int64)
        for j in range(self.k):
            if not len(active):
                break
            if j:
                positions = first[active] + j - 1
                md = self._metadata(rows[active], positions, np.ones(len(active), dtype=np.int64))
                index = torch.from_numpy(active).to(feats.device)
                feats[index] = self._run(tokens[active], feats[index], positions, md)
            guesses = self._guess(feats[torch.from_numpy(active).to(feats.device)]).cpu().numpy()
            tokens[active] = guesses
            for i, t in zip(active.tolist(), guesses.tolist()):
                drafts[i].append(t)
            active = active[room[active] > j + 1]
        return {s.req_id: d for s, d in zip(states, drafts) if d}

    def _target_features(self, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The head's input features at the step's flat token rows ``index``."""
        return hidden[index]

    def _guess(self, feats: torch.Tensor) -> torch.Tensor:
        """[T] target token ids guessed from the head's [T, hidden] outputs."""
        return greedy(self.model.compute_logits(feats))

    def _run(self, ids: np.ndarray, feats: torch.Tensor, positions: np.ndarray, md: AttentionMetadata) -> torch.Tensor:
        device = self.runner.device
        return self.model(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(device), feats,
                          torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(device), md)

    def _metadata(self, rows: np.ndarray, positions: np.ndarray, counts: np.ndarray) -> AttentionMetadata:
        """Requests ``rows`` with ``counts`` consecutive new positions each (``positions``, flat):
        each attends to the head's rows up to its position."""
        runner, bs = self.runner, self.runner.block_size
        table = runner.input_batch.block_table_cpu
        token_rows = np.repeat(rows, counts)
        slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        seq_lens = positions[qsl[1:] - 1] + 1
        num_blocks = -(-int(seq_lens.max()) // bs)

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=runner.device, dtype=dtype)

        return AttentionMetadata(
            num_actual_tokens=int(qsl[-1]), slot_mapping=dev(slots, torch.int64),
            block_tables=dev(table[rows, :num_blocks], torch.int32), query_start_loc=dev(qsl, torch.int32),
            seq_lens=dev(seq_lens, torch.int32), query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()))


class Eagle3Proposer(EagleProposer):
    """The target keeps the residual streams entering the head's aux layers in one static buffer
    (model/llama.py); the head fuses them where EAGLE-1 reads the target's final hidden state."""

    def __init__(self, runner, model, num_speculative_tokens: int) -> None:
        super().__init__(runner, model, num_speculative_tokens)
        layer_ids = aux_layer_ids(model.config, runner.model.config.num_hidden_layers)
        self.aux_hidden_states = runner.model.model.capture_aux_hidden_states(
            layer_ids, max(runner.max_num_tokens, runner.max_num_reqs))

    def follow(self, batch: "_Batch", hidden: torch.Tensor) -> None:
        # The buffer's rows are the step's tokens until the next forward, after this step's proposals.
        self._step = (batch, self.aux_hidden_states)

    def _target_features(self, aux: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.model.fuse(aux[index])

    def _guess(self, feats: torch.Tensor) -> torch.Tensor:
        return self.model.greedy_tokens(feats)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, concatenated."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - counts, counts)
