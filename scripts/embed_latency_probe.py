"""Latency of small embedding requests (online RAG queries), with the piecewise graphs and without.

    python scripts/embed_latency_probe.py [--shape qwen3-0.6b] [--inputs 1,8] [--words 24]

A sentence-transformers folder of the shape with random weights (pagedllm.benchmarks.embed.build),
loaded by two child processes in turn (a GPU's memory comes back only when its engine's process
ends): with the default PAGEDLLM_PIECEWISE_GRAPH_TOKENS, then with 0 (steps with prompt tokens
run eagerly). For each request size, 30 timed `LLM.embed` calls of that many
inputs of --words words each (after 3 untimed); prints one JSON line per engine and size.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from pagedllm import LLM
from pagedllm.benchmarks.embed import WORDS, build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--inputs", default="1,8")
    p.add_argument("--words", type=int, default=24)
    p.add_argument("--profile", action="store_true", help="cProfile 10 one-input calls of each engine")
    p.add_argument("--folder", help=argparse.SUPPRESS)  # set by the parent for its children
    args = p.parse_args()
    if args.folder is None:
        folder = build(args.shape, tempfile.mkdtemp(prefix="pagedllm-embed-"))
        for tokens in (os.environ.get("PAGEDLLM_PIECEWISE_GRAPH_TOKENS", "2048"), "0"):
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--folder", folder], check=True,
                           env={**os.environ, "PAGEDLLM_PIECEWISE_GRAPH_TOKENS": tokens})
        return
    run_engine(args, os.environ["PAGEDLLM_PIECEWISE_GRAPH_TOKENS"])


def run_engine(args: argparse.Namespace, tokens: str) -> None:
    rng = random.Random(0)
    llm = LLM(args.folder, dtype="bfloat16", gpu_memory_utilization=0.3, enable_prefix_caching=False,
              max_model_len=2048)
    for n in map(int, args.inputs.split(",")):
        times = []
        for i in range(33):
            texts = [" ".join(rng.choice(WORDS) for _ in range(args.words)) for _ in range(n)]
            start = time.perf_counter()
            llm.embed(texts, use_tqdm=False)
            if i >= 3:
                times.append((time.perf_counter() - start) * 1e3)
        pieces = llm.llm_engine.engine_core.executor.worker.model_runner.graphs.piecewise
        print(json.dumps({"shape": args.shape, "pieces": tokens, "inputs": n, "words": args.words,
                          "ms_p50": round(statistics.median(times), 2), "ms_min": round(min(times), 2),
                          "piece_replays": pieces.replays if pieces is not None else None}), flush=True)
    if args.profile:  # where one call's time goes
        import cProfile
        import pstats

        texts = [" ".join(rng.choice(WORDS) for _ in range(args.words))]
        with cProfile.Profile() as prof:
            for _ in range(10):
                llm.embed(texts, use_tqdm=False)
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)

if __name__ == "__main__":
    main()
