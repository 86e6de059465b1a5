"""Length-bounded JSON strings compiled as chains (structured_output/xgrammar_strings.py): the
chained grammar accepts exactly the JSON strings the schema's bounds allow, and the budget holds."""
from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from pagedllm import StructuredOutputsParams
from pagedllm.structured_output.backends import xgrammar_grammar
from pagedllm.structured_output.xgrammar_strings import CHAIN_BUDGET, chain_bounded_strings

xgr = pytest.importorskip("xgrammar")

# Pieces of a JSON string body, each one character once decoded, plus two that are never valid.
PIECES = ["a", "Z", " ", "é", "日", '\\"', "\\\\", "\\n", "\\/", "\\u00e9", "\\u20AC"]
INVALID = ["\t", '"']  # a raw control character; an unescaped quote


@pytest.fixture(scope="module")
def compiler():
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)], vocab_type=xgr.VocabType.RAW)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _accepts(compiled, text: str) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(text) and m.is_completed()


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)  # strict: no raw control characters
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.mark.parametrize("bounds", [{"maxLength": 5}, {"minLength": 2, "maxLength": 2}, {"minLength": 3},
                                    {"minLength": 1, "maxLength": 4}])
def test_chain_accepts_exactly_the_bounded_json_strings(compiler, bounds):
    schema = {"type": "object", "properties": {"s": {"type": "string", **bounds},
                                               "t": {"type": "array", "items": {"type": "string", **bounds}}},
              "required": ["s", "t"], "additionalProperties": False}
    grammar = xgrammar_grammar(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert "_characters{" not in str(grammar) and "_n0 ::=" in str(grammar)  # both strings chained
    compiled = compiler.compile_grammar(grammar)
    rng = random.Random(0)
    top = bounds.get("maxLength", bounds.get("minLength", 0) + 3)
    checked = {True: 0, False: 0}
    for _ in range(400):
        pieces = [rng.choice(PIECES + INVALID * (rng.random() < 0.1)) for _ in range(rng.randint(0, top + 2))]
        items = ", ".join('"' + "".join(pieces[rng.randint(0, len(pieces)):]) + '"' for _ in range(rng.randint(0, 2)))
        text = f'{{"s": "{"".join(pieces)}", "t": [{items}]}}'
        ok = _valid(text, schema)
        assert _accepts(compiled, text) == ok, text
        checked[ok] += 1
    assert min(checked.values()) >= 20  # both sides of the bounds were tried


def test_surrogate_escapes_are_left_out(compiler):
    """A UTF-16 pair decodes to one character but would count as two: the chain refuses them."""
    grammar = xgrammar_grammar(StructuredOutputsParams(json={"type": "string", "maxLength": 4}))
    compiled = compiler.compile_grammar(grammar)
    assert _accepts(compiled, '"\\u00e9"') and not _accepts(compiled, '"\\ud83d\\ude00"')


def test_budget_keeps_long_bounds_in_xgrammars_form():
    big = {"type": "string", "maxLength": CHAIN_BUDGET + 10}
    assert "_characters{0, 210}" in str(xgrammar_grammar(StructuredOutputsParams(json=big)))
    half = {"type": "string", "maxLength": CHAIN_BUDGET // 2 + 10}
    schema = {"type": "object", "properties": {"a": half, "b": half}, "required": ["a", "b"]}
    text = chain_bounded_strings(str(xgr.Grammar.from_json_schema(json.dumps(schema))))
    assert text.count("_characters{0, 110}") == 1  # the first chained, the second over budget


def test_text_without_bounded_strings_is_unchanged():
    text = str(xgr.Grammar.from_json_schema(json.dumps({"type": "object", "properties": {"a": {"type": "string"}}})))
    assert chain_bounded_strings(text) == text


NESTED = {"type": "object", "required": ["a", "b", "c", "d"], "$defs": {"name": {"type": "string", "maxLength": 4}},
          "properties": {"a": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}]},
                         "b": {"type": "array", "maxItems": 2, "items": {
                             "type": "array", "maxItems": 2, "items": {"type": "string", "minLength": 1, "maxLength": 2}}},
                         "c": {"$ref": "#/$defs/name"}, "d": {"type": ["string", "null"], "minLength": 2}}}


def _walks(compiled, rng: random.Random, count: int):
    """Texts the grammar produces, one printable ASCII byte at a time at random."""
    bitmask = xgr.allocate_token_bitmask(1, 256)
    for _ in range(count):
        m, out = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True), b""
        while not m.is_terminated() and len(out) < 80:
            m.fill_next_token_bitmask(bitmask, 0)
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:256]
            allowed = [t for t in np.nonzero(bits)[0] if 32 <= t < 127]
            if not allowed:
                break
            token = int(rng.choice(allowed))
            assert m.accept_token(token)
            out += bytes([token])
        if m.is_completed():
            yield out.decode()


def test_chained_and_xgrammars_forms_agree_on_each_others_outputs(compiler):
    """$refs, anyOf, nested arrays, nullable strings: what the chained grammar writes validates
    (and, without escapes, xgrammar's form accepts it); what xgrammar's form writes, the chained
    grammar accepts exactly when it validates."""
    params = StructuredOutputsParams(json=NESTED, disable_any_whitespace=True)
    chained, plain = xgrammar_grammar(params), xgrammar_grammar(params, chained=False)
    assert str(chained).count("_n0 ::=") == 4 and "_characters{" not in str(chained)
    chained, plain = compiler.compile_grammar(chained), compiler.compile_grammar(plain)
    rng, checked = random.Random(0), 0
    for text in _walks(chained, rng, 150):
        jsonschema.validate(json.loads(text), NESTED)
        if "\\" not in text:  # xgrammar's form has no escapes in bounded strings
            assert _accepts(plain, text), text
        checked += 1
    for text in _walks(plain, rng, 150):
        assert _accepts(chained, text) == _valid(text, NESTED), text
        checked += 1
    assert checked > 150
