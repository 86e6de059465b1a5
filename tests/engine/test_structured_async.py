"""Structured outputs with async scheduling on, on a model whose vocabulary is padded past its
tokenizer's: constrained outputs follow their grammar, unconstrained neighbours are
token-identical to a run without them, and a step launched while one with constrained rows is
in flight defers its sampling until that step's tokens have landed (its masks need them)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from tests.conftest import _tiny_config
from tests.engine.test_structured_outputs import PROMPTS, SCHEMAS

PADDED_VOCAB = 49152 + 64


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smollm2_tokenizer_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tmp_path_factory.mktemp("tiny-qwen2-padded"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_tiny_config("qwen2", PADDED_VOCAB), dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_tokenizer_dir).save_pretrained(path)
    return LLM(path, max_model_len=256, async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=16,
               kv_cache_memory_bytes=64 << 20)


def test_async_constrained_and_unconstrained(llm, monkeypatch):
    core = llm.llm_engine.engine_core
    assert core.config.scheduler_config.async_scheduling and core.config.model_config.vocab_size == PADDED_VOCAB
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]

    # The steps launched while one with constrained rows is in flight: each defers its masks,
    # and sample_tokens comes only after that step has landed (it has left the queue).
    over_masked, deferred, sampled = [], [], []
    original, original_sample = core.executor.execute_model, core.executor.sample_tokens

    def execute_model(sched, non_block=False):
        masked = [s for s, _ in core._batch_queue if core._holds_grammar(s)]
        over_masked.append(bool(masked))
        deferred.append(sched.defer_grammar)
        return original(sched, non_block)

    def sample_tokens(grammar):
        assert len(core._batch_queue) == 1 and core._batch_queue[0][0].defer_grammar
        sampled.append(grammar is not None)
        return original_sample(grammar)

    monkeypatch.setattr(core.executor, "execute_model", execute_model)
    monkeypatch.setattr(core.executor, "sample_tokens", sample_tokens)
    prompts, params = [], []
    for i, p in enumerate(PROMPTS):
        so = StructuredOutputsParams(json=SCHEMAS[i], disable_any_whitespace=True)
        prompts += [p, p]
        params += [plain, SamplingParams(temperature=1.0, seed=i, max_tokens=150, n=2, structured_outputs=so)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[::2]] == alone
    for i, out in enumerate(outs[1::2]):
        for sample in out.outputs:
            assert sample.finish_reason == "stop"
            assert max(sample.token_ids) < 49152  # never a padded id
            jsonschema.validate(json.loads(sample.text), SCHEMAS[i])
    assert any(over_masked) and all(d <= m for d, m in zip(deferred, over_masked))
    assert sum(deferred) == len(sampled) and sum(sampled) > 10  # masked rows sampled in deferred steps
    assert core.structured_output.live == {}
