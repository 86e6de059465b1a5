"""InputBatch: the runner's persistent per-request rows, written once when a request is added.

Every running request owns one row (rows are reused) of a few host arrays: its token ids,
its block table, its prompt length, its sampling values (``sample.metadata.SAMPLING_COLUMNS``)
and any extra columns a feature registers. A step's inputs are then vectorized gathers over
those rows, not per-request Python work. The scheduler output of each step updates the rows
(``update``); sampled tokens land through ``append_sampled``.

Where per-request extras attach: ``Column``. A feature that needs a value per request on
the worker (a grammar bitmask row, a LoRA slot, a pooling spec, the k proposed tokens)
registers a column (``InputBatch(columns=...)`` or ``add_column``): the value is computed
from the request's ``NewRequestData`` when the request is added (or resumed after
preemption), kept in ``columns[name][row]`` (a numpy array: numbers gather per token or per
row in one indexing; dtype ``object`` holds anything), and reset to the default when the
request leaves.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from pagedllm.core.sched_output import NewRequestData, SchedulerOutput
from pagedllm.sample.metadata import SAMPLING_COLUMNS, SamplingCounts
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """The worker's copy of a request, kept across steps (and across preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # one list per KV cache group
    num_computed_tokens: int
    row: int  # this request's row in the batch's persistent arrays
    generator: torch.Generator | None = None
    num_inflight: int = 0  # sampled by a step whose result is not read yet (async scheduling)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class Column(NamedTuple):
    """A per-request value kept in one row-indexed array (see the module docstring)."""

    name: str
    dtype: Any  # a numpy dtype; object for anything that is not a number
    default: Any  # the value of a free row
    value: Callable[[NewRequestData], Any]  # computed once, when the request is added


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int,
                 device: torch.device, columns: Iterable[Column] = (), num_kv_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device  # where seeded requests' generators draw
        self.requests: dict[str, CachedRequestState] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))  # popped from the end: row 0 first
        # np.zeros is calloc: untouched rows cost nothing.
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        # One block table per KV cache group (core/kv_cache_groups.py); group 0's is block_table_cpu.
        self.block_tables_cpu = [np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
                                 for _ in range(num_kv_groups)]
        self.block_table_cpu = self.block_tables_cpu[0]
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.sampling = {c.name: np.full(max_num_reqs, c.default, dtype=c.dtype) for c in SAMPLING_COLUMNS}
        self.sampling_counts = SamplingCounts()
        self.columns: dict[str, np.ndarray] = {}
        self._extra_columns: list[Column] = []
        for column in columns:
            self.add_column(column)
        # Seeded requests that were preempted keep their RNG stream until they resume.
        self._preempted_generators: dict[str, torch.Generator] = {}

    def add_column(self, column: Column) -> None:
        """Register a per-request column; requests already in the batch get its default."""
        if column.name in self.columns:
            raise ValueError(f"input batch column {column.name!r} is already registered")
        self.columns[column.name] = np.full(self.max_num_reqs, column.default, dtype=column.dtype)
        self._extra_columns.append(column)

    def rows_of(self, states: Sequence[CachedRequestState]) -> np.ndarray:
        return np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))

    # ---- per step: the scheduler's changes --------------------------------------------------
    def update(self, sched: SchedulerOutput) -> None:
        """Apply one step's scheduler output: drop finished and preempted requests, add new
        (and resumed) ones, extend the block tables and token rows of the others."""
        for req_id in sched.finished_req_ids:
            self._preempted_generators.pop(req_id, None)
            self.drop(req_id)
        for req_id in sched.preempted_req_ids:
            state = self.drop(req_id)
            if state is not None and state.generator is not None:
                self._preempted_generators[req_id] = state.generator
        for new in sched.scheduled_new_reqs:
            self.add_request(new)
        for cached in sched.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.new_block_ids[0]:  # every group gets as many new blocks
                for table, ids, new_ids in zip(self.block_tables_cpu, state.block_ids, cached.new_block_ids):
                    n = len(ids)
                    table[state.row, n:n + len(new_ids)] = new_ids
                    ids.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_token_ids:  # pipeline parallelism: tokens sampled by the last stage
                pos = max(cached.num_computed_tokens, state.num_prompt_tokens)
                for tok in cached.new_token_ids:
                    if pos == len(state.token_ids):  # the last stage already holds its own
                        self.token_ids_cpu[state.row, pos] = tok
                        state.token_ids.append(tok)
                    pos += 1
        for req_id, drafts in sched.scheduled_spec_decode_tokens.items():
            # The step's inputs past the known tokens: written in the row, not (yet) the request's.
            state = self.requests[req_id]
            n = len(state.token_ids)
            self.token_ids_cpu[state.row, n:n + len(drafts)] = drafts

    def step_tables(self, rows: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, num_blocks: int,
                    block_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per KV cache group: the block tables of ``rows`` (``num_blocks`` wide) and the slot of
        each token (``token_rows`` at ``positions``) in that group's blocks."""
        index, offset = positions // block_size, positions % block_size
        return [(t[rows, :num_blocks], t[token_rows, index].astype(np.int64) * block_size + offset)
                for t in self.block_tables_cpu]

    def add_request(self, new: NewRequestData) -> CachedRequestState:
        """Give the request a row and write everything about it that a step reads."""
        generator = self._preempted_generators.pop(new.req_id, None)  # resumed: same RNG stream
        row = self.free_rows.pop()
        params = new.sampling_params
        if generator is None and params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
        self.token_ids_cpu[row, :len(token_ids)] = token_ids
        for table, ids in zip(self.block_tables_cpu, new.block_ids):
            table[row, :len(ids)] = ids
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        for c in SAMPLING_COLUMNS:
            self.sampling[c.name][row] = c.value(params, self.vocab_size)
        self.sampling_counts.add(self.sampling, row)
        for c in self._extra_columns:
            self.columns[c.name][row] = c.value(new)
        state = CachedRequestState(
            req_id=new.req_id, token_ids=token_ids, num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=params, block_ids=tuple(list(ids) for ids in new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            row=row, generator=generator,
        )
        self.requests[new.req_id] = state
        return state

    def drop(self, req_id: str) -> CachedRequestState | None:
        """Forget a request (if held); its row is free for the next one."""
        state = self.requests.pop(req_id, None)
        if state is None:
            return None
        self.sampling_counts.add(self.sampling, state.row, sign=-1)
        # Object columns would otherwise keep what a gone request held alive.
        for c in SAMPLING_COLUMNS:
            if c.dtype is object:
                self.sampling[c.name][state.row] = c.default
        for c in self._extra_columns:
            self.columns[c.name][state.row] = c.default
        self.free_rows.append(state.row)
        return state

    def append_sampled(self, states: Sequence[CachedRequestState], tokens: Sequence[int | list[int]]) -> None:
        """A step's sampled tokens reached the host: append each to its request's row, unless
        the request finished or was preempted (and possibly resumed as a new state) since. A
        request that verified proposed tokens gets a list (its accepted drafts and one more)."""
        for state, tok in zip(states, tokens):
            if self.requests.get(state.req_id) is state:
                new = tok if isinstance(tok, list) else [tok]
                n = len(state.token_ids)
                self.token_ids_cpu[state.row, n:n + len(new)] = new
                state.token_ids.extend(new)
                state.num_inflight -= 1
