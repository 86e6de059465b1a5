"""Host cost of incremental detokenization, µs per output token: tokenizers' Rust DecodeStream
path against the Python window path, on SmolLM2's tokenizer (or --tokenizer DIR).

N streams of T tokens are stepped round-robin, one token per stream per step as the engine's
output processor does (update, then the streamed delta). Token sources: "text" (real English
and multilingual text, cut into streams), "random" (uniform ids over the vocabulary, specials
included, many split characters). Also the logprob token texts (`decode_token`) of k
candidates per token, uncached against cached. One JSON line per figure.

    PYTHONPATH=src python scripts/detok_bench.py [--streams 256 --tokens 256 --repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
import types
from typing import Any

from pagedllm.engine import detokenizer
from pagedllm.engine.detokenizer import IncrementalDetokenizer, decode_token

_TEXT = (
    "The quick brown fox jumps over the lazy dog, and then it writes a short story about a robot "
    "who learns to paint. 世界你好, naïve café résumé — emoji 😀🎉 too. def main():\n    return 42\n"
)


def load_tokenizer(path: str | None) -> Any:
    from pagedllm.engine.arg_utils import default_model
    from pagedllm.tokenizer import get_tokenizer

    gguf = None if path else default_model()
    config = types.SimpleNamespace(tokenizer=path, path=path or os.path.dirname(gguf), gguf_file=gguf,
                                   trust_remote_code=False, tokenizer_mode="auto", revision=None)
    return get_tokenizer(config)


def streams_of(tokenizer: Any, source: str, num_streams: int, num_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if source == "random":
        return [[rng.randrange(len(tokenizer)) for _ in range(num_tokens)] for _ in range(num_streams)]
    ids = tokenizer.encode(_TEXT * (num_tokens // 20 + 2), add_special_tokens=False)
    starts = [rng.randrange(len(ids) - num_tokens) for _ in range(num_streams)]
    return [ids[s : s + num_tokens] for s in starts]


def time_streams(tokenizer: Any, prompt: list[int], streams: list[list[int]], use_decode_stream: bool,
                 stop: list[str]) -> tuple[float, list[str]]:
    """Seconds for all streams (detokenizer construction included) and their texts."""
    start = time.perf_counter()
    detoks = [IncrementalDetokenizer(tokenizer, prompt, stop=stop, use_decode_stream=use_decode_stream)
              for _ in streams]
    for step in range(len(streams[0])):
        for detok, ids in zip(detoks, streams):
            detok.update(ids[step : step + 1])
            detok.get_next_output_text(finished=False, delta=True)
    elapsed = time.perf_counter() - start
    return elapsed, [d.get_next_output_text(finished=True, delta=False) for d in detoks]


def time_logprob_texts(tokenizer: Any, streams: list[list[int]], k: int, cached: bool) -> float:
    """Seconds to name k candidates per token of every stream (OutputProcessor's logprob dicts)."""
    ids = [t for s in streams for t in s]
    if not cached:
        detokenizer._token_texts.pop(tokenizer, None)
    start = time.perf_counter()
    for i in range(len(ids)):
        for j in range(k):
            if cached:
                decode_token(tokenizer, ids[(i + j) % len(ids)])
            else:
                tokenizer.decode([ids[(i + j) % len(ids)]])
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", help="a tokenizer folder (default: SmolLM2's, from the embedded GGUF)")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="report the best of this many runs")
    p.add_argument("--logprobs", type=int, default=6, help="candidates named per token (logprobs=5: 6)")
    args = p.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    prompt = tokenizer.encode("Write a short story about item 7.", add_special_tokens=False)
    num = args.streams * args.tokens
    for source in ("text", "random"):
        streams = streams_of(tokenizer, source, args.streams, args.tokens, seed=0)
        for stop in ([], ["The end.", "###"]):
            figures, texts = {}, {}
            for path, use in (("python_window", False), ("decode_stream", True)):
                runs = [time_streams(tokenizer, prompt, streams, use, stop) for _ in range(args.repeats)]
                figures[path] = min(r[0] for r in runs) / num * 1e6
                texts[path] = runs[0][1]
            print(json.dumps({"benchmark": "detokenize", "source": source, "stop_strings": len(stop),
                              "streams": args.streams, "tokens": args.tokens,
                              "python_window_us_per_token": round(figures["python_window"], 2),
                              "decode_stream_us_per_token": round(figures["decode_stream"], 2),
                              "speedup": round(figures["python_window"] / figures["decode_stream"], 2),
                              "same_text": texts["python_window"] == texts["decode_stream"]}), flush=True)
    streams = streams_of(tokenizer, "text", args.streams, args.tokens, seed=1)
    uncached = min(time_logprob_texts(tokenizer, streams, args.logprobs, False) for _ in range(args.repeats))
    cached = min(time_logprob_texts(tokenizer, streams, args.logprobs, True) for _ in range(args.repeats))
    print(json.dumps({"benchmark": "logprob_token_texts", "candidates_per_token": args.logprobs,
                      "decode_us_per_token": round(uncached / num * 1e6, 2),
                      "cached_us_per_token": round(cached / num * 1e6, 2)}), flush=True)


if __name__ == "__main__":
    main()
