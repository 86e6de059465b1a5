"""Speculative decoding with a draft model: the machinery's ceiling on dummy weights.

Target ``--shape`` (llama3-8b) and draft ``--draft-shape`` (llama3.2-1b, the same vocabulary),
both dummy; ``PAGEDLLM_SPEC_FORCE_ACCEPT=1`` makes every draft accepted (random weights agree
on nothing), so the figures are what the verification and proposal steps cost. Batch 1 and 8,
prompt 128, ``--output-len`` tokens, greedy; for each k, output tokens/s with speculation against
the same engine shape without it, and the ideal (k+1) / (1 + k * draft_cost / target_cost)
from the two models' measured decode step times.

    PAGEDLLM_SPEC_FORCE_ACCEPT=1 python -m pagedllm.benchmarks.spec_draft [--shape llama3-8b] [--draft-shape llama3.2-1b] [--ks 3,5]

``--eagle3``: the proposer is a dummy EAGLE-3 head of the target's shape instead (one decoder layer,
a 32000-token draft vocabulary, the target's three residual streams captured); the speed-up is
reported without an ideal (the head has no plain engine to time).
"""
from __future__ import annotations

import argparse
import random
import time

from pagedllm.benchmarks.common import SHAPES, emit, int_list, release_engines, write_shape


def _rate(llm, batch: int, output_len: int) -> float:
    from pagedllm import SamplingParams, TokensPrompt

    random.seed(0)
    prompts = [TokensPrompt(prompt_token_ids=[random.randint(0, 10000) for _ in range(128)]) for _ in range(batch)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len, detokenize=False)
    llm.generate(prompts, SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    return batch * output_len / best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--draft-shape", choices=sorted(SHAPES), default="llama3.2-1b")
    p.add_argument("--ks", type=int_list, default=[3, 5])
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--eagle3", action="store_true", help="propose with a dummy EAGLE-3 head of the target's shape")
    args = p.parse_args(argv)
    from pagedllm import LLM, envs

    if not envs.PAGEDLLM_SPEC_FORCE_ACCEPT:
        p.error("run with PAGEDLLM_SPEC_FORCE_ACCEPT=1: dummy drafts are accepted only when forced")

    common = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, kv_cache_memory_bytes=4 << 30)
    target_dir, draft_dir = write_shape(args.shape), write_shape(args.draft_shape)
    if args.eagle3:
        draft_dir = _eagle3_head(args.shape)
    plain = {}
    for shape, path in ((args.shape, target_dir),) + (() if args.eagle3 else ((args.draft_shape, draft_dir),)):
        llm = LLM(path, **common)
        plain[shape] = {b: _rate(llm, b, args.output_len) for b in args.batch_sizes}
        del llm
        release_engines()
    for k in args.ks:
        method = "eagle3" if args.eagle3 else "draft_model"
        llm = LLM(target_dir, speculative_config={"method": method, "model": draft_dir, "num_speculative_tokens": k},
                  **common)
        for b in args.batch_sizes:
            rate = _rate(llm, b, args.output_len)
            if args.eagle3:
                emit({"benchmark": "spec_eagle3", "shape": args.shape, "k": k, "batch": b,
                      "plain_output_tok_s": round(plain[args.shape][b], 1), "spec_output_tok_s": round(rate, 1),
                      "speedup": round(rate / plain[args.shape][b], 3)})
                continue
            cost = plain[args.shape][b] / plain[args.draft_shape][b]  # draft step time / target step time
            ideal = (k + 1) / (1 + k * cost)
            emit({"benchmark": "spec_draft", "shape": args.shape, "draft": args.draft_shape, "k": k, "batch": b,
                  "plain_output_tok_s": round(plain[args.shape][b], 1), "spec_output_tok_s": round(rate, 1),
                  "speedup": round(rate / plain[args.shape][b], 3), "ideal_speedup": round(ideal, 3),
                  "of_ideal": round(rate / plain[args.shape][b] / ideal, 3)})
        del llm
        release_engines()


def _eagle3_head(shape: str) -> str:
    """A dummy EAGLE-3 head's folder for ``shape``: its config.json, as the published heads write it."""
    layers, vocab = SHAPES[shape]["num_hidden_layers"], SHAPES[shape]["vocab_size"]
    aux = [2, layers // 2, layers - 3]
    if len(set(aux)) < 3 or min(aux) < 0:  # a shape too shallow for vLLM's default
        aux = [0, layers // 2, layers - 1]
    return write_shape(shape, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                       draft_vocab_size=min(32000, vocab), eagle_aux_hidden_state_layer_ids=aux)


if __name__ == "__main__":
    main()
