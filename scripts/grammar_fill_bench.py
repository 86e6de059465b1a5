"""Host cost of one grammar: compile time, and mask fill / token accept per step on random walks.

Walks the benchmark's JSON schema (pagedllm.benchmarks.structured.SCHEMA) with SmolLM2's
tokenizer, one matcher on one thread, with bounded strings chained (pagedllm's default) and in
xgrammar's own form. Usage: PYTHONPATH=src python scripts/grammar_fill_bench.py TOKENIZER_DIR
"""
from __future__ import annotations

import random
import sys
import time

import numpy as np
import xgrammar as xgr
from transformers import AutoTokenizer

from pagedllm import StructuredOutputsParams
from pagedllm.benchmarks.structured import SCHEMA, VOCAB_SIZE, without_length_bounds
from pagedllm.structured_output.backends import xgrammar_grammar
from pagedllm.structured_output.xgrammar_strings import with_chained_strings


def walk(compiled, tok, walks: int = 20, seed: int = 1) -> tuple[list[float], list[float]]:
    """Random walks through the grammar (mostly word tokens where allowed); per-step times."""
    rng = random.Random(seed)
    words = [tok.encode(" " + w, add_special_tokens=False)[0] for w in "the quick brown fox jumps over a lazy dog".split()]
    bitmask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    fill, accept = [], []
    for _ in range(walks):
        m, steps = xgr.GrammarMatcher(compiled), 0
        while not m.is_terminated() and steps < 300:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            fill.append(time.perf_counter() - t)
            allowed = np.nonzero(np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:VOCAB_SIZE])[0]
            word = rng.choice(words)
            token = word if rng.random() < 0.7 and word in set(allowed.tolist()) else int(rng.choice(allowed))
            t = time.perf_counter()
            assert m.accept_token(token)
            accept.append(time.perf_counter() - t)
            steps += 1
    return fill, accept


def main() -> None:
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB_SIZE), max_threads=1,
                                   cache_enabled=False)
    plain = xgrammar_grammar(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), chained=False)
    grammars = {"bounded, chained": with_chained_strings(plain), "bounded, xgrammar's form": plain,
                "unbounded": xgrammar_grammar(StructuredOutputsParams(json=without_length_bounds(SCHEMA),
                                                                      disable_any_whitespace=True))}
    for name, grammar in grammars.items():
        t = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        compile_s = time.perf_counter() - t
        fill, accept = walk(compiled, tok)
        print(f"{name:26s} compile {compile_s * 1e3:7.0f} ms   fill {np.mean(fill) * 1e6:6.1f} us "
              f"(p90 {np.percentile(fill, 90) * 1e6:6.1f})   accept {np.mean(accept) * 1e6:5.1f} us   steps {len(fill)}")


if __name__ == "__main__":
    main()
