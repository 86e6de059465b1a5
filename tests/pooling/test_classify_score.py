"""Classification against transformers' *ForSequenceClassification, cross-encoder scores against
sentence-transformers' CrossEncoder, embedding-model scores as cosine similarities, and
Qwen3-Reranker's yes/no conversion against the causal LM's own logits (fp32 CPU)."""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.conftest import TEST_KV_BYTES
from pagedllm import LLM, PoolingParams

TEXTS = ["the water is long", "she made a little way into the people", "a", "he was at the first time"]
QUERY = "what is the water"
DOCS = ["the water is long", "people made words", "a little water", "time", "water water water"]


def _hf_logits(folder: str, texts: list, pairs: bool = False) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for t in texts:  # one at a time: no padding question
            enc = tok(*t, return_tensors="pt") if pairs else tok(t, return_tensors="pt")
            rows.append(model(**enc).logits[0])
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["bert-cls3", "qwen3-cls"])
def test_classify_matches_transformers(pooling_models, name):
    llm = LLM(pooling_models[name], kv_cache_memory_bytes=TEST_KV_BYTES, dtype="float32", max_model_len=128,
              max_num_batched_tokens=128)
    probs = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    logits = _hf_logits(pooling_models[name], TEXTS)
    torch.testing.assert_close(probs, logits.softmax(-1), atol=1e-5, rtol=0)
    raw = llm.classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in raw]), logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="task 'embed' does not apply"):
        llm.embed("a", use_tqdm=False)


@pytest.mark.parametrize("name", ["bert-cross", "xlmr-cross"])
def test_cross_encoder_scores_match_sentence_transformers(pooling_models, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import CrossEncoder

        ce = CrossEncoder(pooling_models[name], device="cpu")
        ref = torch.tensor(ce.predict([(QUERY, d) for d in DOCS], convert_to_numpy=True)).float()
    llm = LLM(pooling_models[name], kv_cache_memory_bytes=TEST_KV_BYTES, dtype="float32")
    got = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)])  # 1:N
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    pairs = llm.score(DOCS[:2], DOCS[2:4], use_tqdm=False)  # N:N
    ref2 = torch.tensor(ce.predict(list(zip(DOCS[:2], DOCS[2:4])), convert_to_numpy=True)).float()
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairs]), ref2, atol=1e-5, rtol=0)
    # Token types reach the model: BERT's second segment is type 1, so a pair differs from the
    # same tokens as one segment.
    if name == "bert-cross":
        tok = llm.get_tokenizer()
        enc = tok(QUERY, DOCS[0])
        one = llm.encode([{"prompt_token_ids": enc["input_ids"]}], pooling_task="score", use_tqdm=False)
        assert abs(one[0].outputs.data.item() - got[0].item()) > 1e-6
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(DOCS[:2], DOCS[:3])


def test_embedding_model_scores_are_cosine_similarities(pooling_models):
    # Not normalised by default: score normalises.
    llm = LLM(pooling_models["bert-cls"], kv_cache_memory_bytes=TEST_KV_BYTES, dtype="float32")
    scores = llm.score(QUERY, DOCS, use_tqdm=False)
    emb = torch.tensor([o.outputs.embedding for o in llm.embed([QUERY] + DOCS, use_tqdm=False)])
    ref = torch.nn.functional.cosine_similarity(emb[:1], emb[1:])
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), ref, atol=1e-5, rtol=0)


def test_qwen3_reranker_conversion(pooling_models):
    """hf_overrides as vLLM documents for Qwen3-Reranker: the score is P(yes) over {no, yes} at the
    last token, computed by the causal LM itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = pooling_models["qwen3-lm"]
    tok = AutoTokenizer.from_pretrained(folder)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    llm = LLM(folder, kv_cache_memory_bytes=TEST_KV_BYTES, dtype="float32", max_model_len=128, hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True})
    prompts = [f"query: {QUERY} document: {d} answer:" for d in DOCS]
    got = torch.tensor([o.outputs.probs[0] for o in llm.classify(prompts, use_tqdm=False)])
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([lm(**tok(p, return_tensors="pt")).logits[0, -1, [no, yes]].softmax(-1)[1] for p in prompts])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_pooling_equals_one_rank(pooling_models):
    """An encoder (heads, intermediate rows and output columns split over 2 gloo ranks) and a
    decoder classifier give one rank's embeddings / probabilities."""
    for name, call in (("bert-mean", "embed"), ("qwen3-cls", "classify")):
        outs = []
        for tp in (1, 2):
            llm = LLM(pooling_models[name], kv_cache_memory_bytes=TEST_KV_BYTES, dtype="float32",
                      max_model_len=128, tensor_parallel_size=tp)
            got = getattr(llm, call)(TEXTS, use_tqdm=False)
            outs.append(torch.tensor([o.outputs.embedding if call == "embed" else o.outputs.probs for o in got]))
            del llm
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
