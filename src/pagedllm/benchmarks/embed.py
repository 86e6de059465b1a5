"""Embedding throughput: pagedllm's LLM.embed against sentence-transformers' encode, same run,
same inputs, same dtype (issue 22). Random-weight models of real shapes (BERT-base with CLS
pooling, Qwen3-0.6B with last-token pooling) are written as sentence-transformers folders;
inputs are random word sequences of 32..512 tokens (seeded). pagedllm packs each step's
inputs without padding; sentence-transformers pads each batch to its longest input.

  pagedllm bench embed [--shape bert-base,qwen3-0.6b] [--num-inputs N] [--min-len 32 --max-len 512]
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
import warnings

from pagedllm.benchmarks.common import emit, print_table

SHAPES = {
    "bert-base": dict(kind="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072, vocab_size=30522, max_position_embeddings=512, pooling="cls"),
    "qwen3-0.6b": dict(kind="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                       max_position_embeddings=40960, pooling="lasttoken"),
}
WORDS = [f"w{i}" for i in range(2000)]


def build(shape: str, folder: str) -> str:
    """A sentence-transformers folder of the shape with random weights and a word-level vocabulary
    (one token per word)."""
    import torch
    import transformers
    from transformers import BertTokenizerFast

    spec = dict(SHAPES[shape])
    kind, pooling = spec.pop("kind"), spec.pop("pooling")
    os.makedirs(folder, exist_ok=True)
    vocab_file = os.path.join(folder, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    tok = BertTokenizerFast(vocab_file)
    body_dir = os.path.join(folder, "body")
    torch.manual_seed(0)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**spec))
    else:
        model = transformers.Qwen3Model(transformers.Qwen3Config(**spec, pad_token_id=0))
    model.save_pretrained(body_dir)
    tok.save_pretrained(body_dir)
    del model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer, models

        body = models.Transformer(body_dir)
        st_dir = os.path.join(folder, "st")
        SentenceTransformer(modules=[body, models.Pooling(spec["hidden_size"], pooling_mode=pooling),
                                     models.Normalize()], device="cpu").save(st_dir)
    return st_dir


def inputs(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """``n`` texts of ``lo``..``hi`` tokens each ([CLS] and [SEP] included)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi) - 2)) for _ in range(n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="bert-base,qwen3-0.6b")
    p.add_argument("--num-inputs", type=int, default=None, help="default: 256 on a GPU, 32 on CPU")
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=None, help="default: 512 on a GPU, 256 on CPU")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each (the best counts)")
    p.add_argument("--skip-st", action="store_true")
    args = p.parse_args(argv)

    import torch

    from pagedllm import LLM

    cuda = torch.cuda.is_available()
    n = args.num_inputs or (256 if cuda else 32)
    max_len = args.max_len or (512 if cuda else 256)
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    texts = inputs(n, args.min_len, max_len)
    rows = []
    for shape in args.shape.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            folder = build(shape, tmp)
            llm = LLM(folder, dtype=dtype, max_model_len=max(max_len, 512), max_num_seqs=256,
                      max_num_batched_tokens=16384 if cuda else 4096)
            num_tokens = sum(len(ids) for ids in llm.get_tokenizer()(texts)["input_ids"])
            llm.embed(texts[:8], use_tqdm=False)  # warm-up
            ours = float("inf")
            for _ in range(args.repeats):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = llm.embed(texts, use_tqdm=False)
                ours = min(ours, time.perf_counter() - start)
            row = {"benchmark": "embed", "shape": shape, "dtype": dtype, "num_inputs": n,
                   "lengths": f"{args.min_len}-{max_len}", "tokens": num_tokens,
                   "pagedllm_inputs_s": round(n / ours, 1), "pagedllm_tok_s": round(num_tokens / ours)}
            del llm
            if not args.skip_st:
                from sentence_transformers import SentenceTransformer

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    st = SentenceTransformer(folder, device="cuda" if cuda else "cpu",
                                             model_kwargs={"dtype": getattr(torch, dtype)})
                st.encode(texts[:8], batch_size=args.st_batch_size)
                theirs = float("inf")
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    ref = st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True)
                    if cuda:
                        torch.cuda.synchronize()
                    theirs = min(theirs, time.perf_counter() - start)
                got = torch.tensor([o.outputs.embedding for o in out], device=ref.device)
                cos = torch.nn.functional.cosine_similarity(got.float(), ref.float(), dim=-1).min().item()
                row.update(st_inputs_s=round(n / theirs, 1), st_tok_s=round(num_tokens / theirs),
                           speedup=round(theirs / ours, 2), min_cosine=round(cos, 5))
                del st
            emit(row)
            rows.append(row)
            if cuda:
                torch.cuda.empty_cache()
    print_table(rows, ["shape", "dtype", "num_inputs", "lengths", "pagedllm_inputs_s", "st_inputs_s", "speedup",
                       "min_cosine"])


if __name__ == "__main__":
    main()
