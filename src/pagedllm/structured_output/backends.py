"""Grammar backends (xgrammar, llguidance): validate a constraint, compile it for a tokenizer, match tokens.

Both speak the same packed bitmask: int32 words, bit ``t % 32`` of word ``t // 32`` set when
token ``t`` is allowed. A backend is built once per engine from the tokenizer (the
model's vocabulary size may be padded past the tokenizer's; those ids are never allowed).
"""
from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from typing import Any, Protocol

import numpy as np

from pagedllm.structured_output.xgrammar_strings import with_chained_strings
from pagedllm.structured_params import StructuredOutputsParams


class Matcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool: ...
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None: ...
    def is_terminated(self) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...


def _field(params: StructuredOutputsParams) -> str:
    return f"structured_outputs.{params.kind}"


def choice_as_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def structural_tag_text(tag: dict) -> str:
    """xgrammar's structural tag as JSON text; vLLM's older form ({"structures", "triggers"}) is
    rewritten into the current one (a "triggered_tags" format)."""
    if "structures" in tag and "format" not in tag:
        tags = [{"begin": s["begin"], "end": s["end"],
                 "content": {"type": "json_schema", "json_schema": s.get("schema", {})}}
                for s in tag["structures"]]
        tag = {"type": "structural_tag",
               "format": {"type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags}}
    return json.dumps(tag)


# ---- xgrammar -----------------------------------------------------------------------------------
def xgrammar_grammar(params: StructuredOutputsParams, chained: bool = True) -> Any:
    """The tokenizer-independent grammar: raises on an invalid or unsupported constraint. Cheap
    without ``chained`` (validation); with it, bounded JSON strings are rewritten as chains for
    fast masks (xgrammar_strings.py; ~10 ms for a large schema)."""
    import xgrammar as xgr

    kind = params.kind
    if params.whitespace_pattern is not None:
        raise ValueError("xgrammar does not support whitespace_pattern")
    if kind in ("json", "json_object"):
        schema = json.dumps(params.json) if kind == "json" else '{"type": "object"}'
        bound = {} if params.max_whitespace is None else {"max_whitespace_cnt": params.max_whitespace}
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=not params.disable_any_whitespace, **bound)
        return with_chained_strings(grammar) if chained else grammar
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_as_ebnf(params.choice))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(params.grammar)
    return xgr.Grammar.from_structural_tag(structural_tag_text(params.structural_tag))


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # We cache ourselves. A compile's own threads (its rules' masks in parallel) take half
        # the cores, up to 8: a cold schema's first request waits for its compile.
        threads = max(1, min(8, (os.cpu_count() or 1) // 2))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> Any:
        return self._compiler.compile_grammar(xgrammar_grammar(params))

    def matcher(self, compiled: Any) -> Matcher:
        return XgrammarMatcher(compiled)


class XgrammarMatcher:
    def __init__(self, compiled: Any) -> None:
        import torch
        import xgrammar as xgr

        self._torch = torch
        self._m = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._m.fill_next_token_bitmask(self._torch.from_numpy(bitmask), row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class XgrammarBatchFiller:
    """xgrammar's batch fill: many matchers' rows on ``max_threads`` threads (its C++ releases
    the GIL), one call per step."""

    def __init__(self, max_threads: int) -> None:
        import torch
        import xgrammar as xgr

        self._torch = torch
        self._batch = xgr.BatchGrammarMatcher(max_threads)

    def fill(self, matchers: list[XgrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
        self._batch.batch_fill_next_token_bitmask([m._m for m in matchers], self._torch.from_numpy(bitmask), rows)


XgrammarMatcher.batch_filler = XgrammarBatchFiller


# ---- llguidance ---------------------------------------------------------------------------------
def guidance_grammar(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text; raises on an invalid or unsupported constraint (checked with
    the tokenizer-free validator)."""
    import llguidance as llg

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = dict(params.json) if kind == "json" else {"type": "object"}
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        elif params.max_whitespace is not None:
            options["whitespace_pattern"] = f"[\\x20\\x0A\\x0D\\x09]{{0,{params.max_whitespace}}}"
        if params.disable_any_whitespace:
            options.update(item_separator=",", key_separator=":")
        schema["x-guidance"] = options
        text = llg.grammar_from("json_schema", json.dumps(schema))
    elif kind == "regex":
        text = llg.grammar_from("regex", params.regex)
    elif kind == "choice":
        text = llg.grammar_from("choice", json.dumps(params.choice))
    elif kind == "grammar":
        text = llg.grammar_from("grammar", params.grammar)
    else:
        raise ValueError("llguidance does not support structural_tag")
    error = llg.LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(error)
    return text


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance.hf

        self._stops = frozenset(stop_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids)
                                                       or None)

    def compile(self, params: StructuredOutputsParams) -> Any:
        # llguidance compiles lazily inside the matcher; building one here does the parse (and
        # surfaces errors) off the engine loop. Matchers for requests are fresh copies of it.
        import llguidance as llg

        matcher = llg.LLMatcher(self._tokenizer, guidance_grammar(params))
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Matcher:
        return _GuidanceMatcher(compiled.deep_copy(), self._stops)


class _GuidanceMatcher:
    def __init__(self, m: Any, stop_token_ids: frozenset[int]) -> None:
        import llguidance.numpy as lln

        self._fill = lln.fill_next_token_bitmask
        self._m, self._stops = m, stop_token_ids

    def accept_token(self, token_id: int) -> bool:
        # Checked first: consuming a refused token would leave llguidance's matcher in its error
        # state for good (xgrammar's simply stays where it was).
        # (validate_tokens counts grammar tokens only: a stop token is valid where the grammar accepts.)
        if self._m.validate_tokens([token_id]) != 1 and not (token_id in self._stops and self._m.is_accepting()):
            return False
        return self._m.consume_token(token_id) and not self._m.is_error()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._fill(self._m, bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class GuidanceBatchFiller:
    """llguidance's parallel fill: many matchers' rows on an ``LLExecutor``'s ``max_threads``
    threads (Rust, without the GIL), one call per step."""

    def __init__(self, max_threads: int) -> None:
        import llguidance
        import llguidance.numpy as lln

        self._executor = llguidance.LLExecutor(max_threads)
        self._fill = lln.fill_next_token_bitmask_par

    def fill(self, matchers: list[_GuidanceMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
        self._fill(self._executor, [(m._m, row) for m, row in zip(matchers, rows)], bitmask)


_GuidanceMatcher.batch_filler = GuidanceBatchFiller

BACKEND_CLASSES = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}


def choose_backend(params: StructuredOutputsParams, backend: str, disable_fallback: bool = False) -> str:
    """Validate ``params`` without a tokenizer and pick the backend that takes it: the one asked
    for, or with "auto" xgrammar and else llguidance (vLLM's rule). Raises ValueError naming the
    field when no allowed backend accepts the constraint."""
    order = ["xgrammar", "guidance"] if backend == "auto" else [backend]
    if backend == "auto" and (disable_fallback or params.disable_fallback):
        order = ["xgrammar"]
    key = (tuple(order), params.kind, params.spec_text(), params.options())
    with _CHOSEN_LOCK:
        chosen = _CHOSEN.get(key)
        if chosen is not None:
            _CHOSEN.move_to_end(key)
    if chosen is None:
        chosen = _choose(params, order)
        with _CHOSEN_LOCK:
            _CHOSEN[key] = chosen
            while len(_CHOSEN) > _CHOSEN_ENTRIES:
                _CHOSEN.popitem(last=False)
    if chosen.startswith("error:"):
        raise ValueError(f"{_field(params)} is invalid or unsupported ({chosen[len('error:'):]})")
    return chosen


# Requests tend to repeat a few constraints: each one's verdict is kept (a backend's name or an error).
_CHOSEN: OrderedDict[tuple, str] = OrderedDict()
_CHOSEN_ENTRIES = 256
_CHOSEN_LOCK = threading.Lock()


def _choose(params: StructuredOutputsParams, order: list[str]) -> str:
    errors = []
    for name in order:
        try:
            if name == "xgrammar":
                xgrammar_grammar(params, chained=False)
            else:
                guidance_grammar(params)
            return name
        except Exception as e:  # noqa: BLE001 - the backends raise RuntimeError, ValueError, their own types
            errors.append(f"{name}: {_first_line(e)}")
    return "error:" + "; ".join(errors)


_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /path/x.cc:83: "


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = _CPP_PREFIX.sub("", lines[0]) if lines else type(e).__name__
    return text[:300]
