"""Speculative decoding: the n-gram proposer, the verification rule, and output invariance.

Greedy: a run with speculation emits exactly the tokens of a run without it, with every
prefill chunked, preemption and prefix hits. To control what is proposed, the engine's
proposer is swapped for an oracle that knows the greedy continuation and corrupts some of
it (so both acceptance and rejection happen at known places). Sampling: the verification
rule's emitted tokens follow the target distribution (a test on a 6-token vocabulary with
enough samples to fail a biased rule), and end to end the engine's sampled tokens have the
same distribution with a proposer that is often wrong."""
from __future__ import annotations

import collections

import pytest
import torch

from tests.conftest import TEST_KV_BYTES
from pagedllm import LLM, SamplingParams
from pagedllm.config import SpeculativeConfig
from pagedllm.sample.rejection import verify
from pagedllm.sample.sampler import SamplingMetadata
from pagedllm.spec_decode.ngram import NgramProposer

PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the cat watches from the warm window sill",
    "In a hole in the ground there lived a hobbit",
    "It was the best of times, it was the worst of times, it was the age of wisdom",
    "Call me Ishmael.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class OracleProposer:
    """Proposes each request's true greedy continuation, with every ``wrong_every``-th proposed
    token replaced by a wrong one."""

    def __init__(self, continuations: list[list[int]], k: int = 3, wrong_every: int = 3) -> None:
        self.continuations, self.k, self.wrong_every = continuations, k, wrong_every
        self.calls = 0

    def propose(self, token_ids, max_k=None):
        k = self.k if max_k is None else min(self.k, max_k)
        for full in self.continuations:
            if len(full) > len(token_ids) and full[:len(token_ids)] == list(token_ids):
                self.calls += 1
                guess = full[len(token_ids):len(token_ids) + k]
                return [t + 1 if (self.calls + j) % self.wrong_every == 0 else t for j, t in enumerate(guess)]
        return []


@pytest.fixture(scope="module")
def reference(tiny_models):
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=256)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def spec_llm(tiny_models):
    # Every prefill chunked (16-token steps) and a KV cache small enough to preempt.
    return LLM(tiny_models["llama"], max_model_len=96, max_num_batched_tokens=16, num_gpu_blocks_override=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def _stats(llm):
    return llm.llm_engine.engine_core.scheduler.make_stats()


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3))
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]  # the 3-gram is new; the 2-gram recurs
    assert p.propose([5, 1, 7, 1, 8, 1]) == [8, 1]  # the latest occurrence wins; only 2 tokens follow it
    assert p.propose([1, 2, 3, 4]) == [] and p.propose([3]) == []
    assert p.propose([1, 2, 1, 2, 1], max_k=1) == [2]
    two = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=2))
    assert two.propose([1, 2, 3, 2]) == []  # only a 1-gram recurs


def test_greedy_is_identical_with_drafts_accepted_and_rejected_under_chunking_and_preemption(spec_llm, reference):
    core = spec_llm.llm_engine.engine_core
    saved, core.proposer = core.proposer, OracleProposer(reference)
    try:
        before = _stats(spec_llm)
        outs = spec_llm.generate(PROMPTS + PROMPTS[:2], GREEDY, use_tqdm=False)  # repeats: prefix hits
    finally:
        core.proposer = saved
    got = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    assert got == reference + reference[:2]
    after = _stats(spec_llm)
    drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0 < accepted < drafts  # some drafts accepted, some rejected
    assert after.num_preemptions > 0 and after.prefix_cache_hits > 0
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def count_calls(obj, name: str) -> list:
    """Wraps ``obj.name`` in an instance attribute (``del obj.name`` restores the method) that appends to the
    list returned at each call."""
    calls, real = [], getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(None)
        return real(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


def test_an_exact_proposer_lets_the_target_run_fewer_steps_than_tokens(spec_llm, reference):
    core = spec_llm.llm_engine.engine_core
    saved, core.proposer = core.proposer, OracleProposer(reference, wrong_every=10 ** 9)
    steps = count_calls(core.executor, "execute_model")
    try:
        before = _stats(spec_llm)
        out = spec_llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)[0]
    finally:
        core.proposer = saved
        del core.executor.execute_model
    assert list(out.prompt_token_ids) + list(out.outputs[0].token_ids) == reference[3]
    after = _stats(spec_llm)
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens == \
        after.spec_num_draft_tokens - before.spec_num_draft_tokens > 0  # every draft accepted
    assert len(steps) < len(out.outputs[0].token_ids) // 2


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(spec_llm, reference):
    core = spec_llm.llm_engine.engine_core
    spec = core.config.speculative_config
    oracle = OracleProposer(reference, wrong_every=10 ** 9)
    saved, core.proposer, spec.disable_by_batch_size = core.proposer, oracle, 1
    running_at_proposal, running_at_step = [], []
    propose, execute = oracle.propose, core.executor.execute_model

    def recording_propose(*args, **kwargs):
        running_at_proposal.append(len(core.scheduler.running))
        return propose(*args, **kwargs)

    def recording_execute(*args, **kwargs):
        running_at_step.append(len(core.scheduler.running))
        return execute(*args, **kwargs)

    oracle.propose, core.executor.execute_model = recording_propose, recording_execute
    try:
        outs = spec_llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    finally:
        core.proposer, spec.disable_by_batch_size = saved, None
        del core.executor.execute_model
    assert [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs] == reference[:3]
    assert max(running_at_step) > 1 and running_at_proposal and max(running_at_proposal) <= 1


def test_verification_keeps_the_target_distribution():
    """Rows: request r's row 0 and row 1 (after its draft 0), then the bonus row. The first
    emitted token must follow p0, and given that draft 0 was emitted, the second must follow p1."""
    torch.manual_seed(0)
    n, vocab = 60000, 6
    p0 = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.05, 0.2])
    p1 = torch.tensor([0.3, 0.05, 0.25, 0.1, 0.2, 0.1])
    p2 = torch.full((vocab,), 1 / vocab)
    logits = torch.stack([p0.log(), p1.log(), p2.log()]).repeat(n, 1)
    drafts = torch.tensor([1, 2, -1]).repeat(n)  # draft 0 is likely under p0; draft 1 less so under p1
    md = SamplingMetadata(temperature=torch.ones(3 * n), all_greedy=False, all_random=True)
    emitted = verify(logits, md, drafts, [2] * n)
    first = torch.tensor([e[0] for e in emitted])
    second = torch.tensor([e[1] for e in emitted if e[0] == 1])
    assert (torch.bincount(first, minlength=vocab) / n - p0).abs().sum() / 2 < 0.01
    assert (torch.bincount(second, minlength=vocab) / len(second) - p1).abs().sum() / 2 < 0.015
    assert max(len(e) for e in emitted) == 3 and min(len(e) for e in emitted) == 1


def test_greedy_verification_accepts_exactly_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    md = SamplingMetadata(temperature=torch.zeros(3), all_greedy=True, all_random=False)
    assert verify(logits, md, torch.tensor([1, 0, -1]), [2]) == [[1, 0, 2]]
    assert verify(logits, md, torch.tensor([1, 2, -1]), [2]) == [[1, 0]]
    assert verify(logits, md, torch.tensor([0, 0, -1]), [2]) == [[1]]


class CandidateProposer:
    """After the first output token t1, proposes the second token that a plain run saw least
    often after t1: a token the target may sample, but usually does not."""

    def __init__(self, num_prompt: int, rare: dict[int, int]) -> None:
        self.num_prompt, self.rare = num_prompt, rare

    def propose(self, token_ids, max_k=None):
        if len(token_ids) != self.num_prompt + 1 or not max_k or token_ids[-1] not in self.rare:
            return []
        return [self.rare[token_ids[-1]]]


def test_sampled_tokens_follow_the_same_distribution_with_a_proposer_that_is_often_wrong(tiny_models):
    """top_k=3 keeps the support small (at most 9 pairs (t1, t2)); the two runs' empirical
    distributions of the first two tokens must agree (total variation)."""
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES,
              max_model_len=64, speculative_config={"method": "ngram", "num_speculative_tokens": 1})
    core = llm.llm_engine.engine_core
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    runs, prompt = 1000, PROMPTS[1]
    core.proposer = None
    plain = llm.generate([prompt] * runs, params, use_tqdm=False)
    pairs = collections.Counter(tuple(o.outputs[0].token_ids[:2]) for o in plain)
    rare = {}
    for (t1, t2), _ in sorted(pairs.items(), key=lambda kv: kv[1]):
        rare.setdefault(t1, t2)
    core.proposer = CandidateProposer(len(plain[0].prompt_token_ids), rare)
    before = _stats(llm)
    spec = collections.Counter(tuple(o.outputs[0].token_ids[:2]) for o in llm.generate([prompt] * runs, params,
                                                                                         use_tqdm=False))
    after = _stats(llm)
    drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafts > runs // 2 and 0 < accepted < drafts // 2
    keys = set(pairs) | set(spec)
    assert len(keys) <= 9
    assert sum(abs(pairs[k] - spec[k]) for k in keys) / (2 * runs) < 0.12


@pytest.mark.parametrize("kwargs, match", [
    (dict(speculative_config={"method": "medusa"}), "'medusa' is not supported yet"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 0}), "num_speculative_tokens"),
    (dict(speculative_config={"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}), "prompt_lookup_min"),
    (dict(speculative_config={"method": "ngram", "lookahead": 2}), "unknown speculative_config key"),
    (dict(speculative_config={"method": "ngram"}, async_scheduling=True), "async_scheduling"),
    (dict(speculative_config="{not json"), "not valid JSON"),
    (dict(speculative_model="[ngram]", num_speculative_tokens=2, speculative_config={"num_speculative_tokens": 4}),
     "disagree"),
])
def test_bad_speculative_configs_are_refused_naming_the_key(tiny_models, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=64, **kwargs)


def test_older_flat_flags_map_onto_the_config(tiny_models):
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES,
              max_model_len=64, speculative_model="[ngram]", num_speculative_tokens=2,
              ngram_prompt_lookup_max=4, speculative_disable_by_batch_size=8)
    spec = llm.llm_engine.engine_core.config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.disable_by_batch_size) == \
        ("ngram", 2, 4, 8)


def test_the_counters_reach_prometheus_and_the_cli_takes_the_config():
    from prometheus_client import generate_latest

    from pagedllm.core.messages import SchedulerStats
    from pagedllm.entrypoints.cli import engine_args_from, make_parser
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.on_step(SchedulerStats(spec_num_drafts=3, spec_num_draft_tokens=9, spec_num_accepted_tokens=5,
                                   spec_accepted_per_pos=[3, 2, 0]), 0, 0)
    metrics.on_step(SchedulerStats(spec_num_drafts=4, spec_num_draft_tokens=12, spec_num_accepted_tokens=6,
                                   spec_accepted_per_pos=[4, 2, 0]), 0, 0)
    text = generate_latest(metrics.registry).decode()
    assert 'pagedllm:spec_decode_num_accepted_tokens_total{model_name="m"} 6.0' in text
    assert 'pagedllm:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0' in text
    ns = make_parser().parse_args(["serve", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_args_from(ns).speculative_config == {"method": "ngram", "num_speculative_tokens": 5}


def test_constrained_and_penalised_requests_decode_one_token_per_step_beside_drafted_ones(spec_llm, reference):
    """A grammar or a penalty keeps its request off speculation (exact as without it); the
    unconstrained request beside them still verifies drafts."""
    from pagedllm import StructuredOutputsParams

    core = spec_llm.llm_engine.engine_core
    saved, core.proposer = core.proposer, OracleProposer(reference, wrong_every=10 ** 9)
    try:
        before = _stats(spec_llm)
        choice = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
            choice=["alpha", "beta"]))
        penalised = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
        outs = spec_llm.generate([PROMPTS[3], PROMPTS[3], PROMPTS[3]], [choice, penalised, GREEDY], use_tqdm=False)
    finally:
        core.proposer = saved
    assert outs[0].outputs[0].text in ("alpha", "beta")
    assert list(outs[2].prompt_token_ids) + list(outs[2].outputs[0].token_ids) == reference[3]
    after = _stats(spec_llm)
    drafted_steps = after.spec_num_drafts - before.spec_num_drafts
    assert 0 < drafted_steps <= len(reference[3])  # only the plain request drafted
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
