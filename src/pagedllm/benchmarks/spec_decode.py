"""Speculative decoding benchmark: n-gram prompt lookup on a copy-heavy prompt set.

The real model (default: the embedded SmolLM2-135M-Instruct) is asked to repeat or lightly
edit a passage given in the prompt, the workload prompt lookup is for. The same prompts run
greedily with and without ``speculative_config`` in one process, one request at a time
(batch 1) or all at once (``--batch``); the result line gives output tokens/s of both, the
speed-up, the acceptance rate and mean accepted tokens per drafted step, and whether the
tokens were identical (they must be).

    python -m pagedllm.benchmarks.spec_decode [--model M] [--k 3] [--batch 1] [--dtype float32]
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.common import emit, parse_engine_args, release_engines

PASSAGES = [
    "The committee met on Tuesday to review the budget. Travel costs rose by twelve percent, while office "
    "supplies fell slightly. The chair proposed moving the annual retreat to the spring, and the members agreed "
    "to revisit the proposal at the next meeting after collecting quotes from three venues.",
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n"
    "    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n",
    "Mix the flour and the salt in a large bowl. Add the warm water and the yeast, then knead the dough for ten "
    "minutes until it is smooth. Leave it to rise for an hour, shape it into a loaf and bake it for forty minutes.",
]
ASKS = ["Repeat the text above exactly.", "Copy the text above, word for word, then stop.",
        "Rewrite the text above with every sentence on its own line."]


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": PASSAGES[i % len(PASSAGES)] + "\n\n" + ASKS[(i // len(PASSAGES)) % len(ASKS)]}]
            for i in range(n)]


def _minus(after, before) -> SimpleNamespace:
    """The speculation counters of the timed run alone."""
    keys = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
    return SimpleNamespace(**{k: getattr(after, k) - getattr(before, k) for k in keys})


def _run(llm: LLM, chats: list, params: SamplingParams, batch: int) -> tuple[float, list[list[int]]]:
    start, tokens = time.perf_counter(), []
    for i in range(0, len(chats), batch):
        outs = llm.chat(chats[i:i + batch], params, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="None: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=9)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--engine-args", default="", help="extra EngineArgs as k=v,k=v")
    args = p.parse_args(argv)
    common = dict(model=args.model, dtype=args.dtype, max_model_len=2048, **parse_engine_args(args.engine_args))
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.prompt_lookup_max}
    chats, params = prompts(args.num_prompts), SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results = {}
    for name, extra in (("plain", {}), ("ngram", {"speculative_config": spec_cfg})):
        llm = LLM(**common, **extra)
        # Warm-up: on a GPU the whole workload once (Triton compiles a kernel the first time a
        # shape is seen: verification steps bring new ones); elsewhere one short request.
        warm = (chats, params) if torch.cuda.is_available() else (chats[:1], SamplingParams(temperature=0.0, max_tokens=8))
        _run(llm, *warm, args.batch)
        stats0 = llm.llm_engine.engine_core.scheduler.make_stats()
        seconds, tokens = _run(llm, chats, params, args.batch)
        results[name] = (seconds, tokens, _minus(llm.llm_engine.engine_core.scheduler.make_stats(), stats0))
        del llm
        release_engines()
    (t0, tok0, _), (t1, tok1, stats) = results["plain"], results["ngram"]
    n = sum(len(t) for t in tok0)
    emit({"benchmark": "spec_decode", "method": "ngram", "model": args.model or "SmolLM2-135M-Instruct",
          "k": args.k, "batch": args.batch, "num_prompts": args.num_prompts, "output_tokens": n,
          "plain_output_tok_s": round(n / t0, 1), "spec_output_tok_s": round(sum(len(t) for t in tok1) / t1, 1),
          "speedup": round(t0 / t1, 3),
          "acceptance_rate": round(stats.spec_num_accepted_tokens / max(stats.spec_num_draft_tokens, 1), 3),
          "mean_accepted_per_drafted_step": round(stats.spec_num_accepted_tokens / max(stats.spec_num_drafts, 1), 2),
          "identical_tokens": tok0 == tok1})


if __name__ == "__main__":
    main()
