"""Tiny pooling models built with the reference libraries: sentence-transformers saves the
embedding models (its modules.json / 1_Pooling config name the pooling), transformers the
classifiers. One set per session; each test module builds its engines once."""
from __future__ import annotations

import os
import warnings

import pytest

WORDS = ("the a of and to in is was he she it that for on with as his her they at by this had from not but what "
         "all were when we there can an your which their said if do will each about how up out them then many some "
         "so these would other into has more two like him see time could no make than first been its who now people "
         "my made over did down only way find use may water long little very after words called just where most "
         "know query document answer relevant").split()


def bert_tokenizer(folder: str):
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz",
             *("##" + c for c in "abcdefghijklmnopqrstuvwxyz")]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab))
    return BertTokenizerFast(path)


def _encoder_config(kind: str, vocab_size: int, **extra):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=160, initializer_range=0.2, **extra)
    if kind == "bert":
        return transformers.BertConfig(**common)
    return transformers.XLMRobertaConfig(**common, pad_token_id=0, bos_token_id=2, eos_token_id=3)


def _sentence_transformer(model_dir: str, out: str, mode: str, normalize: bool) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer, models

        body = models.Transformer(model_dir)
        mods = [body, models.Pooling(body.get_word_embedding_dimension(), pooling_mode=mode)]
        if normalize:
            mods.append(models.Normalize())
        SentenceTransformer(modules=mods, device="cpu").save(out)
    return out


@pytest.fixture(scope="session")
def pooling_models(tmp_path_factory, smollm2_tokenizer_dir) -> dict[str, str]:
    """name -> folder. Embedders (sentence-transformers folders): bert-mean (normalised),
    bert-cls (not normalised), xlmr-cls, qwen3-last (not normalised), qwen3-mean (normalised).
    Classifiers (transformers): bert-cls3 (3 labels), bert-cross (1 label: a cross-encoder),
    xlmr-cross, qwen3-cls (2 labels); qwen3-lm (a causal LM, for the reranker conversion)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("pooling")
    tok = bert_tokenizer(str(root / "bert-vocab"))
    out: dict[str, str] = {}
    torch.manual_seed(0)
    for kind, cls in (("bert", transformers.BertModel), ("xlmr", transformers.XLMRobertaModel)):
        d = str(root / f"{kind}-body")
        cls(_encoder_config(kind, len(tok))).save_pretrained(d)
        tok.save_pretrained(d)
        if kind == "bert":
            out["bert-mean"] = _sentence_transformer(d, str(root / "bert-mean"), "mean", True)
            out["bert-cls"] = _sentence_transformer(d, str(root / "bert-cls"), "cls", False)
        else:
            out["xlmr-cls"] = _sentence_transformer(d, str(root / "xlmr-cls"), "cls", True)
    for name, cls, kind, labels in (("bert-cls3", transformers.BertForSequenceClassification, "bert", 3),
                                    ("bert-cross", transformers.BertForSequenceClassification, "bert", 1),
                                    ("xlmr-cross", transformers.XLMRobertaForSequenceClassification, "xlmr", 1)):
        d = str(root / name)
        cls(_encoder_config(kind, len(tok), num_labels=labels)).save_pretrained(d)
        tok.save_pretrained(d)
        out[name] = d

    qtok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    qtok.pad_token = qtok.pad_token or qtok.eos_token
    qcfg = dict(vocab_size=len(qtok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                initializer_range=0.25, tie_word_embeddings=True, pad_token_id=qtok.pad_token_id)
    d = str(root / "qwen3-body")
    transformers.Qwen3Model(transformers.Qwen3Config(**qcfg)).save_pretrained(d)
    # Without a chat template: sentence-transformers 6 would wrap plain texts in it (as a message).
    body_tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    body_tok.chat_template = None
    body_tok.pad_token = qtok.pad_token
    body_tok.save_pretrained(d)
    out["qwen3-last"] = _sentence_transformer(d, str(root / "qwen3-last"), "lasttoken", False)
    out["qwen3-mean"] = _sentence_transformer(d, str(root / "qwen3-mean"), "mean", True)
    d = str(root / "qwen3-cls")
    transformers.Qwen3ForSequenceClassification(transformers.Qwen3Config(**qcfg, num_labels=2)).save_pretrained(d)
    qtok.save_pretrained(d)
    out["qwen3-cls"] = d
    d = str(root / "qwen3-lm")
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**qcfg)).save_pretrained(d)
    qtok.save_pretrained(d)
    out["qwen3-lm"] = d
    return out
