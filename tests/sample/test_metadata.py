"""Sampling metadata from row columns: the same tensors the per-step Python build gave, built
only for the features some row uses."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pagedllm.sample.metadata import (SAMPLING_COLUMNS, SamplingCounts, SamplingMetadataBuilder, banned_tokens,
                                      feature_bits, sampling_features)
from pagedllm.sampling_params import SamplingParams

VOCAB = 40
ROWS = 8


@dataclass
class State:
    sampling_params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class Rows:
    """Requests written into row columns the way the input batch writes them."""

    def __init__(self) -> None:
        self.columns = {c.name: np.full(ROWS, c.default, dtype=c.dtype) for c in SAMPLING_COLUMNS}
        self.token_ids = np.zeros((ROWS, 64), dtype=np.int64)
        self.num_prompt = np.zeros(ROWS, dtype=np.int64)
        self.counts = SamplingCounts()
        self.builder = SamplingMetadataBuilder(self.columns, self.counts, self.token_ids, self.num_prompt, VOCAB,
                                               torch.device("cpu"))

    def put(self, row: int, state: State) -> None:
        for c in SAMPLING_COLUMNS:
            self.columns[c.name][row] = c.value(state.sampling_params, VOCAB)
        self.counts.add(self.columns, row)
        self.token_ids[row, :len(state.token_ids)] = state.token_ids
        self.num_prompt[row] = state.num_prompt_tokens

    def build(self, states: list[State], rows: list[int]):
        rows_np = np.asarray(rows, dtype=np.int64)
        return self.builder.build(states, rows_np, torch.from_numpy(self.builder.temperature(rows_np)))


def reference_metadata(states: list[State]) -> dict:
    """What the runner built per step in Python before the columns (its rules, restated)."""
    params = [s.sampling_params for s in states]
    feats = frozenset().union(*(sampling_features(p) for p in params))
    ref = {"temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32),
           "all_greedy": all(p.temperature == 0.0 for p in params),
           "all_random": all(p.temperature != 0.0 for p in params)}
    if "top_p" in feats:
        ref["top_p"] = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    if "top_k" in feats:
        ref["top_k"] = torch.tensor([min(p.top_k or VOCAB, VOCAB) for p in params], dtype=torch.long)
    if "min_p" in feats:
        ref["min_p"] = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    for name, attr in (("presence", "presence_penalty"), ("frequency", "frequency_penalty"),
                       ("repetition", "repetition_penalty")):
        if name in feats:
            ref[name + "_penalties"] = torch.tensor([float(getattr(p, attr)) for p in params])
    if "repetition" in feats:
        width = max(s.num_prompt_tokens for s in states)
        prompts = torch.full((len(states), width), VOCAB, dtype=torch.long)
        for i, s in enumerate(states):
            prompts[i, :s.num_prompt_tokens] = torch.tensor(s.token_ids[:s.num_prompt_tokens])
        ref["prompt_token_ids"] = prompts
    if "logprobs" in feats:
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        ref["max_num_logprobs"] = -1 if -1 in wanted else max(wanted)
    ref["logit_bias"] = {i: {int(k): float(v) for k, v in p.logit_bias.items()}
                         for i, p in enumerate(params) if p.logit_bias}
    return ref


def random_params(rng: random.Random) -> SamplingParams:
    kw = {"temperature": rng.choice([0.0, 0.5, 1.0, 1.3])}
    for name, values in (("top_p", [0.8, 0.95]), ("top_k", [1, 5, 100]), ("min_p", [0.1]),
                         ("presence_penalty", [0.5, -1.0]), ("frequency_penalty", [0.3]),
                         ("repetition_penalty", [1.2, 0.9]), ("logprobs", [0, 3, -1]),
                         ("logit_bias", [{3: 2.5, "7": -1}]), ("seed", [11])):
        if rng.random() < 0.25:
            kw[name] = rng.choice(values)
    return SamplingParams(**kw)


@pytest.mark.parametrize("seed", range(12))
def test_columns_give_the_tensors_the_per_step_build_gave(seed):
    rng = random.Random(seed)
    rows = Rows()
    states = []
    for row in range(ROWS):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        state = State(random_params(rng), prompt + [rng.randrange(VOCAB) for _ in range(rng.randrange(4))], len(prompt))
        if state.sampling_params.seed is not None:
            state.generator = torch.Generator().manual_seed(state.sampling_params.seed)
        rows.put(row, state)
        states.append(state)
    picked = rng.sample(range(ROWS), rng.randrange(1, ROWS + 1))  # a step samples some rows, in any order
    md = rows.build([states[r] for r in picked], picked)
    ref = reference_metadata([states[r] for r in picked])
    assert torch.equal(md.temperature, ref["temperature"])
    assert (md.all_greedy, md.all_random) == (ref["all_greedy"], ref["all_random"])
    for name in ("top_p", "top_k", "min_p", "presence_penalties", "frequency_penalties", "repetition_penalties",
                 "prompt_token_ids"):
        got = getattr(md, name)
        assert (got is None) == (name not in ref), name
        if got is not None:
            assert got.dtype == ref[name].dtype and torch.equal(got, ref[name]), name
    assert md.max_num_logprobs == ref.get("max_num_logprobs")
    assert md.logit_bias == ref["logit_bias"]
    assert md.generators == {i: states[r].generator for i, r in enumerate(picked) if states[r].generator}
    history = any(set(sampling_features(states[r].sampling_params)) & {"presence", "frequency", "repetition"}
                  for r in picked)
    assert (md.output_token_ids == [states[r].output_token_ids for r in picked]) if history \
        else md.output_token_ids == []


def test_plain_temperature_rows_build_nothing_else():
    rows = Rows()
    states = [State(SamplingParams(temperature=t), [1, 2], 2) for t in (0.0, 0.7)]
    for row, s in enumerate(states):
        rows.put(row, s)
    md = rows.build(states, [1, 0])
    assert md.temperature.tolist() == [pytest.approx(0.7), 0.0]
    assert not md.all_greedy and not md.all_random
    assert md.top_p is None and md.top_k is None and md.generators == {} and md.output_token_ids == []
    assert rows.build(states[:1], [0]).all_greedy and rows.build(states[1:], [1]).all_random


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_batch_of_one_kind_answers_from_its_counts(temperature):
    """Every request greedy (or none): no column is gathered, and the answer is the same."""
    rows = Rows()
    states = [State(SamplingParams(temperature=temperature), [1, 2], 2) for _ in range(3)]
    for row, s in enumerate(states):
        rows.put(row, s)
    assert (rows.counts.requests, rows.counts.greedy, rows.counts.featured) == (3, 3 * (temperature == 0), 0)
    rows.columns["greedy"][:] = not rows.columns["greedy"][0]  # poisoned: a gather would see it
    md = rows.build(states[1:], [1, 2])
    assert (md.all_greedy, md.all_random) == (temperature == 0.0, temperature != 0.0)
    assert rows.builder.needs_history(np.array([0, 1])) is None


def test_allowed_tokens_bans_and_processors_are_per_row():
    def proc(prompt, output, logits):
        return logits

    rows = Rows()
    p_allowed = SamplingParams(allowed_token_ids=[3, 5])
    p_min = SamplingParams(min_tokens=3, stop_token_ids=[9])
    p_min.update_from_generation_config({2})
    p_proc = SamplingParams(logits_processors=[proc])
    states = [State(p_allowed, [1], 1), State(p_min, [1, 4], 1), State(p_proc, [6, 7, 8], 2)]
    for row, s in enumerate(states):
        rows.put(row, s)
    md = rows.build(states, [0, 1, 2])
    mask = md.allowed_token_ids_mask
    assert mask.shape == (3, VOCAB) and not mask[0, 3] and not mask[0, 5] and mask[0].sum() == VOCAB - 2
    assert not mask[1:].any()
    assert sorted(md.banned_token_ids[1]) == [2, 9] and set(md.banned_token_ids) == {1}
    assert md.logits_processors == {2: ([proc], [6, 7])}
    assert md.output_token_ids == [[], [4], [8]]
    assert rows.builder.needs_history(np.array([0, 1, 2])).tolist() == [False, True, True]


def test_banned_tokens_follow_min_tokens_and_bad_word_prefixes():
    p = SamplingParams(min_tokens=2, stop_token_ids=[0])
    p._bad_words_token_ids = [[5], [6, 7], [1, 2, 3]]  # as update_from_tokenizer leaves them
    assert sorted(banned_tokens(p, [])) == [0, 5]
    assert sorted(banned_tokens(p, [6])) == [0, 5, 7]
    assert sorted(banned_tokens(p, [6, 1, 2])) == [3, 5]  # min_tokens reached: stop tokens allowed again
    assert sorted(banned_tokens(p, [1, 2, 6])) == [5, 7]


def test_feature_bits_flag_exactly_the_features_used():
    assert feature_bits(SamplingParams()) == 0
    assert feature_bits(SamplingParams(temperature=0.0, top_p=0.5, top_k=3)) == 0  # greedy drops them
    assert sampling_features(SamplingParams(seed=1, logprobs=0)) == {"seed", "logprobs"}


def test_padded_prompts_pad_with_the_vocabulary_size():
    rows = Rows()
    rows.put(0, State(SamplingParams(), [4, 5, 6, 7], 3))
    rows.put(1, State(SamplingParams(), [8, 9], 1))
    assert rows.builder.padded_prompts(np.array([1, 0])).tolist() == [[8, VOCAB, VOCAB], [4, 5, 6]]
