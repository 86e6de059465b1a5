"""Embeddings against sentence-transformers on tiny random models (fp32 CPU): encoders (BERT
MEAN normalised, BERT CLS raw, XLM-R CLS), a Qwen3 body (LAST raw, MEAN normalised), mixed
lengths, prompts longer than one prefill chunk, preemption, Matryoshka dimensions, bad input."""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.conftest import TEST_KV_BYTES
from pagedllm import LLM, PoolingParams

TEXTS = [
    "the water is long",
    "she made a little way into the people and they called it words",
    "a",
    " ".join(["what all were when we there can an your which their said if do will each about how"] * 6),
    "he was at the first time",
]


def _st_encode(folder: str, texts: list[str]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(folder, device="cpu")
        return model.encode(texts, convert_to_tensor=True, batch_size=8).float()


def _check(got: torch.Tensor, ref: torch.Tensor, raw: bool) -> None:
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min().item() >= 0.99999, cos
    if raw:  # not normalised: the values themselves (a wrong MEAN denominator fails here)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(got)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,raw", [("bert-mean", False), ("bert-cls", True), ("xlmr-cls", False)])
def test_encoders_match_sentence_transformers(pooling_models, name, raw):
    # 5 prompts: two steps
    llm = LLM(pooling_models[name], kv_cache_memory_bytes=TEST_KV_BYTES, dtype="float32", max_num_seqs=3)
    core = llm.llm_engine.engine_core
    assert llm.llm_engine.model_config.is_encoder and not core.kv_cache_manager.enable_caching
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    _check(got, _st_encode(pooling_models[name], TEXTS), raw)


@pytest.fixture(scope="module")
def qwen_last(pooling_models):
    # A 24-token budget: the long prompt runs in several chunks.
    return LLM(pooling_models["qwen3-last"], kv_cache_memory_bytes=TEST_KV_BYTES, dtype="float32",
               max_num_batched_tokens=24, max_num_seqs=4, max_model_len=256)


def test_decoder_last_token_across_chunks_and_prefix_hits(qwen_last, pooling_models):
    ref = _st_encode(pooling_models["qwen3-last"], TEXTS)
    got = torch.tensor([o.outputs.embedding for o in qwen_last.embed(TEXTS, use_tqdm=False)])
    _check(got, ref, raw=True)
    # LAST pooling reuses cached prefixes: the same prompts again hit the cache, same vectors.
    again = qwen_last.embed(TEXTS, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in again]), got, atol=1e-5, rtol=0)
    assert qwen_last.llm_engine.engine_core.executor.worker.model_runner.pooling.pooler.num_partial() == 0


def test_decoder_mean_across_chunks_and_preemption(pooling_models):
    """MEAN over prompts in several chunks; one request preempted mid-prompt (its blocks freed,
    recomputed from its first token: its running sum restarts) still gives the reference."""
    llm = LLM(pooling_models["qwen3-mean"], kv_cache_memory_bytes=TEST_KV_BYTES, dtype="float32",
              max_num_batched_tokens=32, max_num_seqs=4, max_model_len=160)
    engine = llm.llm_engine
    core = engine.engine_core
    assert not core.kv_cache_manager.enable_caching  # MEAN reads every token: no prefix reuse
    ref = _st_encode(pooling_models["qwen3-mean"], TEXTS)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    _check(got, ref, raw=False)
    engine.add_request("long", TEXTS[3], PoolingParams(task="embed"))
    engine.step()
    request = core.scheduler.requests["long"]
    assert 0 < request.num_computed_tokens < request.num_prompt_tokens
    core.scheduler._preempt(request)
    core.scheduler._pending_preempted_req_ids.add("long")  # as a step that preempts tells the workers
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert core.scheduler.num_preemptions == 1 and request.num_preemptions == 1
    _check(outs[0].outputs.data[None], ref[3:4], raw=False)
    assert core.executor.worker.model_runner.pooling.pooler.num_partial() == 0


@pytest.mark.parametrize("pooling_type", ["ALL", "CLS"])
def test_decoder_rows_kept_across_chunks_equal_transformers(pooling_models, pooling_type):
    """ALL (every token's state) and CLS (the first token's) of a decoder whose prompts run in
    several chunks: the rows kept from earlier chunks equal transformers'. On a GPU the chunks
    replay piecewise graphs, whose output buffer each step overwrites: the pooler must copy them.
    A pooling runner captures no decode graphs: its steps are all prompts."""
    from transformers import AutoModel

    folder = pooling_models["qwen3-last"]
    llm = LLM(folder, pooler_config={"pooling_type": pooling_type}, kv_cache_memory_bytes=TEST_KV_BYTES,
              dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256)  # 32: the smallest piece
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    outs = llm.encode([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(out.outputs.data, ref if pooling_type == "ALL" else ref[0], atol=1e-4, rtol=1e-4)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runner.pooling.pooler.num_partial() == 0
    if torch.cuda.is_available():  # prompts only: the pieces replayed, and no decode graph was captured
        assert runner.graphs.piecewise.replays > 0
        assert not runner.graphs.graphs and not runner.graphs.sizes


def test_encode_gives_the_raw_pooled_states_and_activation_switches(qwen_last):
    enc = qwen_last.encode(TEXTS[:2], use_tqdm=False)
    emb = qwen_last.embed(TEXTS[:2], use_tqdm=False)
    normed = qwen_last.embed(TEXTS[:2], PoolingParams(normalize=True), use_tqdm=False)
    for e, m, n in zip(enc, emb, normed):
        torch.testing.assert_close(torch.tensor(m.outputs.embedding), e.outputs.data)  # the ST folder: raw
        torch.testing.assert_close(torch.tensor(n.outputs.embedding),
                                   torch.nn.functional.normalize(e.outputs.data, dim=0))


def test_matryoshka_dimensions(pooling_models):
    llm = LLM(pooling_models["bert-mean"], kv_cache_memory_bytes=TEST_KV_BYTES, dtype="float32",
              hf_overrides={"matryoshka_dimensions": [16, 32]})
    full = llm.embed(TEXTS[:2], PoolingParams(use_activation=False), use_tqdm=False)
    short = llm.embed(TEXTS[:2], PoolingParams(dimensions=16), use_tqdm=False)
    for f, s in zip(full, short):
        assert len(s.outputs.embedding) == 16
        torch.testing.assert_close(torch.tensor(s.outputs.embedding),
                                   torch.nn.functional.normalize(torch.tensor(f.outputs.embedding[:16]), dim=0))
    with pytest.raises(ValueError, match="dimensions=8 is not one of"):
        llm.embed("a", PoolingParams(dimensions=8), use_tqdm=False)


def test_bad_input_is_refused_and_the_engine_keeps_serving(qwen_last, pooling_models):
    with pytest.raises(ValueError, match="does not generate"):
        qwen_last.generate("the water")
    with pytest.raises(ValueError, match="empty"):
        qwen_last.embed("", use_tqdm=False)
    with pytest.raises(ValueError, match="more than max_model_len"):
        qwen_last.embed([list(range(5, 300))], use_tqdm=False)
    long = qwen_last.embed([list(range(5, 300))], truncate_prompt_tokens=100, use_tqdm=False)
    assert len(long[0].prompt_token_ids) == 100
    with pytest.raises(ValueError, match="does not support matryoshka"):
        qwen_last.embed("a", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="task 'classify' does not apply"):
        qwen_last.classify("a", use_tqdm=False)
    assert len(qwen_last.embed(TEXTS[:1], use_tqdm=False)[0].outputs.embedding) == 64
    # Aborted mid-prompt: its blocks and its pooling state are freed.
    engine = qwen_last.llm_engine
    engine.add_request("x", TEXTS[3], PoolingParams(task="embed"))
    engine.step()
    engine.abort_request("x")
    engine.step()
    assert engine.engine_core.executor.worker.model_runner.pooling.pooler.num_partial() == 0


def test_runner_and_task_arguments(pooling_models):
    with pytest.raises(ValueError, match="is a pooling model: it cannot generate"):
        LLM(pooling_models["bert-cls3"], kv_cache_memory_bytes=TEST_KV_BYTES, runner="generate")
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(pooling_models["bert-cls3"], kv_cache_memory_bytes=TEST_KV_BYTES, runner="encode")
    with pytest.raises(ValueError, match="enable_chunked_prefill=True does not apply to encoder"):
        LLM(pooling_models["bert-mean"], kv_cache_memory_bytes=TEST_KV_BYTES, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match="unknown pooler_config key"):
        LLM(pooling_models["bert-mean"], kv_cache_memory_bytes=TEST_KV_BYTES, pooler_config={"pooling": "MEAN"})
    # A causal LM converted by task="embed" (vLLM's older flag): last-token states of its body.
    llm = LLM(pooling_models["qwen3-lm"], kv_cache_memory_bytes=TEST_KV_BYTES, task="embed", dtype="float32",
              max_model_len=128)
    assert llm.llm_engine.model_config.runner_type == "pooling"
    out = llm.embed(TEXTS[:2], use_tqdm=False)
    assert abs(torch.tensor(out[0].outputs.embedding).norm().item() - 1) < 1e-5
    with pytest.raises(ValueError, match="generative model"):
        LLM(pooling_models["qwen3-lm"], kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=64).embed("a")


def test_xlmr_positions_stop_before_the_table_ends(pooling_models):
    """RoBERTa's positions start at padding_idx + 1 (pad_token_id 0 here, 1 in XLM-R's own
    checkpoints): the longest input is padding_idx + 1 shorter than the position table (the GPU's
    profiling forward runs inputs of exactly this length)."""
    llm = LLM(pooling_models["xlmr-cls"], kv_cache_memory_bytes=TEST_KV_BYTES, dtype="float32")
    assert llm.llm_engine.model_config.max_model_len == 160 - 0 - 1
    out = llm.embed([[5 + i % 100 for i in range(159)]], use_tqdm=False)
    assert len(out[0].outputs.embedding) == 32
