"""Small prefill steps with LoRA adapters: host-bound, where the piecewise graphs help.

    PAGEDLLM_PIECEWISE_GRAPH_TOKENS=2048 python scripts/lora_prefill_probe.py llama3-8b
    PAGEDLLM_PIECEWISE_GRAPH_TOKENS=0 python scripts/lora_prefill_probe.py llama3-8b

Dummy weights of a benchmark shape, four random rank-16 adapters over all seven projections
(pushed from memory). Each step prefills four fresh 96-token prompts, each on its own adapter,
and samples one token (one 384-token step); 33 steps, the first 3 untimed. Prints one JSON line:
the median and fastest ms per step, and how many piecewise sizes were captured with adapters.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

from pagedllm import LLM, SamplingParams, TokensPrompt
from pagedllm.benchmarks.common import write_shape
from pagedllm.benchmarks.lora import push_random_adapters


def main(shape: str) -> None:
    llm = LLM(write_shape(shape), load_format="dummy", skip_tokenizer_init=True, enable_lora=True, max_loras=4,
              max_lora_rank=16, max_model_len=2048)
    loras = push_random_adapters(llm, 4, 16)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    times = []
    for step in range(33):
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(100, 30000) for _ in range(96)]) for _ in range(4)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        if step >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    pieces = llm.llm_engine.engine_core.executor.worker.model_runner.graphs.piecewise
    print(json.dumps({"shape": shape, "pieces": os.environ.get("PAGEDLLM_PIECEWISE_GRAPH_TOKENS"),
                      "lora_piece_sizes": len(pieces.lora_graphs) if pieces else 0,
                      "ms_p50": round(statistics.median(times), 2), "ms_min": round(min(times), 2)}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llama3-8b")
