"""InputBatch: rows written once when a request is added, updated by each step's scheduler output."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sample.metadata import BIT, NO_LOGPROBS
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import Column, InputBatch

VOCAB = 50


def make_batch(**kwargs) -> InputBatch:
    return InputBatch(max_num_reqs=4, max_model_len=32, max_blocks_per_req=8, vocab_size=VOCAB,
                      device=torch.device("cpu"), **kwargs)


def new_req(req_id: str, prompt=(1, 2, 3), output=(), blocks=(7,), computed=0, **params) -> NewRequestData:
    return NewRequestData(req_id, list(prompt), list(output), SamplingParams(**params), (list(blocks),),
                          computed)


def step(new=(), cached=(), finished=(), preempted=()) -> SchedulerOutput:
    return SchedulerOutput(list(new), list(cached), {}, 0, set(finished), set(preempted))


def test_add_writes_tokens_blocks_and_sampling_values_into_one_row():
    batch = make_batch()
    batch.update(step(new=[new_req("a"), new_req("b", prompt=(4, 5), output=(6,), blocks=(3, 9), top_k=100,
                                                 top_p=0.5, logprobs=2, logit_bias={"7": 1}, temperature=0.7)]))
    a, b = batch.requests["a"], batch.requests["b"]
    assert (a.row, b.row) == (0, 1)  # lowest free row first
    assert b.token_ids == [4, 5, 6] and b.num_prompt_tokens == 2 and b.output_token_ids == [6]
    assert batch.token_ids_cpu[1, :3].tolist() == [4, 5, 6] and batch.block_table_cpu[1, :2].tolist() == [3, 9]
    assert batch.num_prompt_tokens[[0, 1]].tolist() == [3, 2]
    cols = batch.sampling
    assert cols["temperature"][1] == np.float32(0.7) and not cols["greedy"][1]
    assert cols["top_k"][[0, 1]].tolist() == [VOCAB, VOCAB]  # disabled and too large: the whole vocabulary
    assert cols["logprobs"][[0, 1]].tolist() == [NO_LOGPROBS, 2]
    assert cols["logit_bias"][1] == {7: 1.0} and cols["logit_bias"][0] is None
    assert cols["features"][0] == 0
    assert cols["features"][1] == BIT["top_p"] | BIT["top_k"] | BIT["logprobs"] | BIT["bias"]


def test_cached_requests_extend_block_tables_and_take_the_last_stages_tokens():
    batch = make_batch()
    batch.update(step(new=[new_req("a", blocks=(7,))]))
    batch.update(step(cached=[CachedRequestData("a", ([8, 2],), 3)]))
    a = batch.requests["a"]
    assert a.block_ids == ([7, 8, 2],) and batch.block_table_cpu[a.row, :3].tolist() == [7, 8, 2]
    assert a.num_computed_tokens == 3
    # Pipeline parallelism: output tokens arrive from the last stage (from position
    # max(num_computed_tokens, prompt length) on); the ones already held are skipped.
    batch.update(step(cached=[CachedRequestData("a", ([],), 3, new_token_ids=[11])]))
    batch.update(step(cached=[CachedRequestData("a", ([],), 3, new_token_ids=[11, 12])]))
    assert a.token_ids == [1, 2, 3, 11, 12] and batch.token_ids_cpu[a.row, :5].tolist() == [1, 2, 3, 11, 12]


def test_dropped_rows_are_reused_and_object_columns_let_go():
    batch = make_batch()
    batch.update(step(new=[new_req(r) for r in "abcd"]))
    assert batch.free_rows == []
    row_b = batch.requests["b"].row
    batch.update(step(new=[new_req("e", logit_bias={1: -5.0}, allowed_token_ids=[1, 2])], finished=["b"]))
    e = batch.requests["e"]
    assert e.row == row_b and set(batch.requests) == {"a", "c", "d", "e"}
    assert batch.sampling["allowed_token_ids"][e.row] == [1, 2]
    batch.update(step(finished=["e", "unknown"]))  # an id the batch never held is ignored
    assert batch.sampling["logit_bias"][row_b] is None and batch.sampling["allowed_token_ids"][row_b] is None
    assert sorted(batch.free_rows) == [row_b]


def test_sampling_counts_follow_adds_and_drops():
    batch = make_batch()
    batch.update(step(new=[new_req("g", temperature=0.0), new_req("p", presence_penalty=0.5), new_req("t", top_p=0.9)]))
    counts = batch.sampling_counts
    assert (counts.requests, counts.greedy, counts.featured, counts.history) == (3, 1, 2, 1)
    batch.update(step(finished=["g", "p"], preempted=["t"]))
    assert (counts.requests, counts.greedy, counts.featured, counts.history) == (0, 0, 0, 0)


def test_preempted_seeded_request_resumes_with_its_rng_stream():
    batch = make_batch()
    batch.update(step(new=[new_req("a", seed=7), new_req("b")]))
    gen = batch.requests["a"].generator
    assert batch.requests["b"].generator is None and batch.sampling["features"][0] & BIT["seed"]
    first = torch.rand(3, generator=gen)
    batch.update(step(preempted=["a"]))
    assert "a" not in batch.requests
    batch.update(step(new=[new_req("a", output=(5,), seed=7)]))
    resumed = batch.requests["a"]
    assert resumed.generator is gen  # the stream goes on where it was, not from the seed again
    assert not torch.equal(torch.rand(3, generator=resumed.generator), first)
    batch.update(step(preempted=["a"]))
    batch.update(step(finished=["a"]))  # finished while preempted: the stream is forgotten
    batch.update(step(new=[new_req("a", seed=7)]))
    assert torch.equal(torch.rand(3, generator=batch.requests["a"].generator), first)


def test_append_sampled_lands_only_on_the_state_that_sampled():
    batch = make_batch()
    batch.update(step(new=[new_req("a"), new_req("b")]))
    a, b = batch.requests["a"], batch.requests["b"]
    a.num_inflight = b.num_inflight = 1
    batch.update(step(preempted=["b"]))
    batch.update(step(new=[new_req("b", prompt=(4,))]))  # b resumed: a new state in a new row
    batch.append_sampled([a, b], [21, 22])
    assert a.token_ids == [1, 2, 3, 21] and a.num_inflight == 0 and batch.token_ids_cpu[a.row, 3] == 21
    assert batch.requests["b"].token_ids == [4] and b.token_ids == [1, 2, 3]


def test_extra_columns_are_written_on_add_and_reset_on_drop():
    """The attach point for per-request extras: a number (say a LoRA slot, gathered per token
    in one indexing) and an object (say k proposed tokens)."""
    batch = make_batch(columns=[Column("slot", np.int32, -1, lambda new: len(new.prompt_token_ids))])
    batch.add_column(Column("proposal", object, None, lambda new: list(new.output_token_ids)))
    with pytest.raises(ValueError, match="slot"):
        batch.add_column(Column("slot", np.int32, 0, lambda new: 0))
    batch.update(step(new=[new_req("a", prompt=(1, 2)), new_req("b", output=(9, 8))]))
    a, b = batch.requests["a"], batch.requests["b"]
    assert batch.columns["slot"][[a.row, b.row]].tolist() == [2, 3]
    assert batch.columns["slot"][np.array([b.row, b.row, a.row])].tolist() == [3, 3, 2]  # per-token gather
    assert batch.columns["proposal"][b.row] == [9, 8]
    batch.update(step(finished=["b"]))
    assert batch.columns["slot"][b.row] == -1 and batch.columns["proposal"][b.row] is None
