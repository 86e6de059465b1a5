"""Params validation, backend choice, the compile cache, matchers (advance, rollback, padded
vocabulary) for both backends, on SmolLM2's real tokenizer."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pagedllm import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from pagedllm.config import StructuredOutputsConfig
from pagedllm.structured_output.backends import choose_backend
from pagedllm.structured_output.manager import StructuredOutputManager

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}
VOCAB = 49152 + 40  # a model vocabulary padded past the tokenizer's 49152


def _allowed(bitmask: np.ndarray, row: int = 0) -> np.ndarray:
    return np.nonzero(np.unpackbits(bitmask[row].view(np.uint8), bitorder="little"))[0]


# ---- params -----------------------------------------------------------------------------------------
def test_exactly_one_kind_named_in_the_error():
    with pytest.raises(ValueError, match=r"exactly one of .*got \['json', 'regex'\]"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="structured_outputs.json must be a JSON schema"):
        StructuredOutputsParams(json=3)
    with pytest.raises(ValueError, match="structured_outputs.regex must be a string"):
        StructuredOutputsParams(regex=5)
    with pytest.raises(ValueError, match="guided_decoding.backend"):
        GuidedDecodingParams(regex="a", backend="outlines")


def test_json_forms_and_the_guided_decoding_alias():
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    assert StructuredOutputsParams(json=Person).json == Person.model_json_schema()
    assert StructuredOutputsParams(json=json.dumps(SCHEMA)).json == SCHEMA
    sp = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    assert sp.structured_outputs.choice == ["a", "b"] and sp.guided_decoding is None
    assert sp.clone().structured_outputs.choice == ["a", "b"]
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       guided_decoding=GuidedDecodingParams(regex="b"))
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_limits_name_the_field():
    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(ValueError, match=r"structured_outputs.json nests \d+ levels deep"):
        StructuredOutputsParams(json=deep).check_limits(1 << 20, 32)
    with pytest.raises(ValueError, match=r"structured_outputs.regex is 5000 bytes, over the limit of 4096"):
        StructuredOutputsParams(regex="a" * 5000).check_limits(4096, 32)
    StructuredOutputsParams(json=SCHEMA).check_limits(4096, 32)  # within both


def test_backend_choice():
    assert choose_backend(StructuredOutputsParams(json=SCHEMA), "auto") == "xgrammar"
    # xgrammar has no whitespace_pattern: auto falls back to llguidance, as vLLM's auto does.
    ws = StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?")
    assert choose_backend(ws, "auto") == "guidance"
    with pytest.raises(ValueError, match="structured_outputs.json is invalid or unsupported .*whitespace_pattern"):
        choose_backend(ws, "auto", disable_fallback=True)
    with pytest.raises(ValueError, match="structured_outputs.json"):
        choose_backend(ws, "xgrammar")
    lark = StructuredOutputsParams(grammar='start: "a" | "b"')  # Lark: only llguidance reads it
    assert choose_backend(lark, "auto") == "guidance"
    tag = StructuredOutputsParams(structural_tag={"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]})
    assert choose_backend(tag, "auto") == "xgrammar"
    with pytest.raises(ValueError, match="structured_outputs.structural_tag .*guidance: llguidance does not"):
        choose_backend(tag, "guidance")
    for params, name in ((StructuredOutputsParams(regex="("), "regex"),
                         (StructuredOutputsParams(json={"type": "objectx"}), "json"),
                         (StructuredOutputsParams(grammar='root ::= "a'), "grammar")):
        with pytest.raises(ValueError, match=f"structured_outputs.{name} is invalid or unsupported"):
            choose_backend(params, "auto")


# ---- manager and matchers ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def manager(tokenizer):
    m = StructuredOutputManager(StructuredOutputsConfig(), VOCAB, lambda: tokenizer, [2])
    yield m
    m.shutdown()


def _ready(manager, req_id, params, backend):
    params._backend = backend
    handle = manager.add_request(req_id, params)
    handle.future.result(timeout=60)
    assert manager.poll() == [] and handle.is_ready()
    return handle


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_matcher_advances_rolls_back_and_terminates(manager, tokenizer, backend):
    handle = _ready(manager, "r", StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), backend)
    assert manager.words == -(-VOCAB // 32)
    text = '{"a": 3, "b": "y"}' if backend == "xgrammar" else '{"a":3,"b":"y"}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    masks = []
    for tok in ids:
        gm = manager.bitmask([handle])
        masks.append(gm.bitmask[0].copy())
        assert gm.req_ids == ["r"] and tok in _allowed(gm.bitmask)
        assert not _allowed(gm.bitmask)[-1] >= len(tokenizer)  # padded ids are never allowed
        assert handle.accept_tokens([tok])
    assert _allowed(manager.bitmask([handle]).bitmask).tolist() == [2]  # only EOS is left
    # Speculative decoding's rollback: k tokens back, the mask is the one seen there.
    handle.rollback(3)
    assert np.array_equal(manager.bitmask([handle]).bitmask[0], masks[-3])
    assert handle.accept_tokens(ids[-3:])
    assert not handle.accept_tokens([tokenizer.encode("zz", add_special_tokens=False)[0]])
    with pytest.raises(ValueError, match="cannot roll back"):
        handle.rollback(len(ids) + 1)
    assert handle.accept_tokens([2]) and handle.is_terminated()
    handle.free()
    assert "r" not in manager.live and handle.matcher is None


def test_cache_compiles_each_spec_once_and_failures_fail_their_request(manager, monkeypatch):
    calls = []
    original = manager._compile
    monkeypatch.setattr(manager, "_compile", lambda p: calls.append(p.kind) or original(p))
    regex = StructuredOutputsParams(regex=r"[0-9]{3}")
    a = _ready(manager, "a", regex, "xgrammar")
    b = _ready(manager, "b", StructuredOutputsParams(regex=r"[0-9]{3}"), "xgrammar")
    assert a.future is b.future and calls == ["regex"]
    assert a.matcher is not b.matcher  # one matcher per request
    c = _ready(manager, "c", StructuredOutputsParams(regex=r"[0-9]{3}"), "guidance")  # another backend: its own
    assert c.future is not a.future and calls == ["regex", "regex"]
    bad = StructuredOutputsParams(regex="(")
    bad._backend = "xgrammar"
    handle = manager.add_request("bad", bad)
    with pytest.raises(Exception):
        handle.future.result(timeout=60)
    assert manager.poll() == [handle] and "structured_outputs.regex could not be compiled" in handle.error
    for h in (a, b, c, handle):
        h.free()
    assert manager.live == {} and manager.pending == {}


def test_structural_tag_constrains_the_tagged_region(manager, tokenizer):
    tag = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
           "triggers": ["<f>"]}
    handle = _ready(manager, "tag", StructuredOutputsParams(structural_tag=tag), "xgrammar")
    assert handle.matcher is not None
    ok = tokenizer.encode('hi <f>{"a": 1, "b": "x"}</f>', add_special_tokens=False)
    assert handle.accept_tokens(ok)
    # Inside the tag the schema rules: "b" must be "x" or "y".
    bad = _ready(manager, "tag2", StructuredOutputsParams(structural_tag=tag), "xgrammar")
    assert not bad.accept_tokens(tokenizer.encode('<f>{"a": 1, "b": "z"}', add_special_tokens=False))
    handle.free()
    bad.free()
    assert manager.live == {}
