"""Structured outputs end to end on a tiny random-weight model (its unconstrained output is
noise: a pass means the constraint did the work). One engine for the module, built so that
every prefill is chunked (16-token steps) and a busy batch is preempted (20 KV blocks)."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from pagedllm import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.backends import XgrammarBackend

SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["user", "active"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["name", "age"], "properties": {
            "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
        "active": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["tags", "level"], "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "level": {"enum": ["low", "mid", "high"]}}},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 2, "maxItems": 4},
    {"type": "object", "additionalProperties": False, "required": ["id"], "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "ok": {"type": "boolean"}}},
]
PROMPTS = [  # each longer than one 16-token step: every prefill is chunked
    "The quick brown fox jumps over the lazy dog while the cat watches from the warm window sill",
    "In a hole in the ground there lived a hobbit, not a nasty dirty wet hole filled with worms",
    "It was the best of times, it was the worst of times, it was the age of wisdom and foolishness",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse",
]


@pytest.fixture(scope="module")
def llm(tiny_models):
    # float32: what is compared is the scheduling and the masks; in bfloat16 a GPU's GEMMs round
    # differently at other batch sizes, which flips greedy ties of the tiny random model.
    return LLM(tiny_models["llama"], dtype="float32", max_model_len=256, num_gpu_blocks_override=20,
               max_num_batched_tokens=16, max_num_seqs=16, structured_outputs_config={"compile_timeout_s": 10.0})


@pytest.fixture(autouse=True)
def no_grammar_left(llm):
    """Whatever a test did, no matcher or compile is held for a request after it."""
    yield
    manager = llm.llm_engine.engine_core.structured_output
    assert manager.live == {} and manager.pending == {}


def _constrained(so: StructuredOutputsParams, seed: int, max_tokens: int = 150, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, n=n, structured_outputs=so)


def _unconstrained(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_finite_json_schemas_always_parse_and_validate(llm):
    params, schemas = [], []
    for i, schema in enumerate(SCHEMAS):
        for seed in range(5):
            params.append(_constrained(StructuredOutputsParams(json=schema, disable_any_whitespace=True), 10 * i + seed))
            schemas.append(schema)
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(params))], params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert len({o.outputs[0].text for o in outs}) > len(SCHEMAS)  # sampled, not one fixed answer


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[a-z]{2,6}-\d{2,4}"
    choices = ["alpha", "beta gamma", 'quo"te\\d']
    grammar = 'root ::= "(" num op num ")"\nnum ::= [0-9] | [1-9] [0-9]\nop ::= "+" | "*" | "-"'
    kinds = [StructuredOutputsParams(regex=regex), StructuredOutputsParams(choice=choices),
             StructuredOutputsParams(grammar=grammar), GuidedDecodingParams(regex=regex, backend="guidance")]
    params = [_constrained(so, seed) for so in kinds for seed in range(4)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(params))], params, use_tqdm=False)
    for i, out in enumerate(outs):
        text, kind = out.outputs[0].text, i // 4
        assert out.outputs[0].finish_reason == "stop"
        if kind in (0, 3):
            assert re.fullmatch(regex, text), text
        elif kind == 1:
            assert text in choices
        else:
            assert re.fullmatch(r"\((0|[1-9]\d?)[+*-](0|[1-9]\d?)\)", text), text
    objs = llm.generate(PROMPTS, [_constrained(StructuredOutputsParams(json_object=True), s, max_tokens=60)
                                  for s in range(4)], use_tqdm=False)
    finished = [o.outputs[0].text for o in objs if o.outputs[0].finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(t), dict) for t in finished)
    for o in objs:  # the unbounded ones cut at max_tokens are still an object's beginning
        assert o.outputs[0].text.lstrip().startswith("{")


def _mixed_run(llm, plain_prompts, constrained, n: int = 1):
    """Unconstrained greedy requests interleaved with constrained ones: their token ids, and
    the constrained outputs with their kinds."""
    prompts, params = [], []
    for i, p in enumerate(plain_prompts):
        prompts.append(p)
        params.append(_unconstrained())
        if i < len(constrained):
            prompts.append(PROMPTS[i % 4])
            params.append(_constrained(constrained[i], seed=i, n=n))
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = [o.outputs[0].token_ids for o, p in zip(outs, params) if p.structured_outputs is None]
    return plain, [o for o, p in zip(outs, params) if p.structured_outputs is not None]


@pytest.mark.parametrize("n", [1, 3])
def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(llm, n):
    plain_prompts = [p + f" chapter {i}" for i, p in enumerate(PROMPTS * 2)]
    alone = [o.outputs[0].token_ids for o in llm.generate(plain_prompts, _unconstrained(), use_tqdm=False)]
    preemptions = llm.llm_engine.engine_core.scheduler.num_preemptions
    constrained = [StructuredOutputsParams(json=SCHEMAS[i % 4], disable_any_whitespace=True) for i in range(6)]
    plain, outs = _mixed_run(llm, plain_prompts, constrained, n=n)
    assert plain == alone
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > preemptions  # preempted along the way
    for i, out in enumerate(outs):
        assert len(out.outputs) == n
        for sample in out.outputs:
            assert sample.finish_reason == "stop"
            jsonschema.validate(json.loads(sample.text), SCHEMAS[i % 4])


def test_compile_runs_off_the_engine_loop(llm, monkeypatch):
    """A compile made slow on purpose: the unconstrained request runs to its end meanwhile."""
    original = XgrammarBackend.compile

    def slow_compile(self, params):
        time.sleep(1.5)
        return original(self, params)

    monkeypatch.setattr(XgrammarBackend, "compile", slow_compile)
    engine = llm.llm_engine
    engine.add_request("slow", PROMPTS[0], _constrained(StructuredOutputsParams(regex=r"slow-[0-9]{3}"), 1))
    engine.add_request("plain", PROMPTS[1], _unconstrained(max_tokens=6))
    start, texts = time.monotonic(), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = (out.outputs[0].text, time.monotonic() - start)
                if out.request_id == "plain":
                    assert engine.engine_core.structured_output.pending  # the grammar still compiles
    assert texts["plain"][1] < 1.5 <= texts["slow"][1]
    assert re.fullmatch(r"slow-[0-9]{3}", texts["slow"][0])


def test_bad_constraints_fail_their_request_alone(llm, monkeypatch):
    good = SamplingParams(temperature=0, max_tokens=4)
    bad_cases = [
        (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json is invalid or unsupported"),
        (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex is invalid or unsupported"),
        (StructuredOutputsParams(grammar='root ::= "a'), "structured_outputs.grammar is invalid or unsupported"),
        (StructuredOutputsParams(regex="a" * 70000), "structured_outputs.regex is 70000 bytes, over the limit"),
        (StructuredOutputsParams(json=_deep_schema(40)), "structured_outputs.json nests 8[0-9] levels deep"),
    ]
    for so, message in bad_cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([PROMPTS[0], PROMPTS[1]], [good, SamplingParams(structured_outputs=so)], use_tqdm=False)
        assert llm.generate(PROMPTS[2], good, use_tqdm=False)[0].outputs[0].token_ids  # the next one is served
    # Too slow to compile: the compile timeout fails it (in the engine core, after it was queued).
    manager = llm.llm_engine.engine_core.structured_output
    monkeypatch.setattr(manager.config, "compile_timeout_s", 0.3)
    original = XgrammarBackend.compile
    monkeypatch.setattr(XgrammarBackend, "compile", lambda self, p: time.sleep(1.0) or original(self, p))
    with pytest.raises(ValueError, match=r"structured_outputs.regex took longer than compile_timeout_s=0.3 s"):
        llm.generate([PROMPTS[0]] * 2, [good, SamplingParams(structured_outputs=StructuredOutputsParams(
            regex=r"timeout-[0-9]+"))], use_tqdm=False)
    monkeypatch.undo()
    out = llm.generate(PROMPTS[3], [_constrained(StructuredOutputsParams(choice=["yes", "no"]), 0)], use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def test_abort_while_compiling_and_while_running_frees_the_matcher(llm, monkeypatch):
    original = XgrammarBackend.compile
    monkeypatch.setattr(XgrammarBackend, "compile", lambda self, p: time.sleep(0.5) or original(self, p))
    engine, manager = llm.llm_engine, llm.llm_engine.engine_core.structured_output
    engine.add_request("compiling", PROMPTS[0], _constrained(StructuredOutputsParams(regex=r"abort-[0-9]{3}"), 1))
    engine.step()
    assert "compiling" in manager.pending
    engine.abort_request("compiling")
    assert manager.live == {} and manager.pending == {}
    engine.add_request("running", PROMPTS[1], _constrained(StructuredOutputsParams(json=SCHEMAS[0]), 2))
    while not engine.engine_core.scheduler.requests["running"].output_token_ids:
        engine.step()
    assert manager.live["running"].is_ready()
    engine.abort_request("running")
    assert manager.live == {}
    while engine.has_unfinished_requests():  # async scheduling (GPU): a step may still be in flight
        engine.step()
    assert manager.live == {}
