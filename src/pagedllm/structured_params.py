"""StructuredOutputsParams: the one constraint a request's output must follow (vLLM's names)."""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields
from typing import Any

# The constraint kinds, in the order their fields are checked; exactly one must be set.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
BACKENDS = ("auto", "xgrammar", "guidance")


def _nesting_depth(value: Any) -> int:
    """Depth of nested dicts/lists, without recursion (a hostile schema cannot blow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children)
    return deepest


@dataclass
class StructuredOutputsParams:
    """Set exactly one of ``json`` (a JSON schema: dict, JSON text or pydantic model class),
    ``regex``, ``choice`` (list of strings), ``grammar`` (EBNF/GBNF or Lark), ``json_object``
    (any JSON object) or ``structural_tag`` (xgrammar's structural tag, dict or JSON text)."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # pagedllm's bound on each run of whitespace in JSON (None: any length, as vLLM): a model
    # that loops on newlines inside a JSON value ends instead of spending max_tokens on them.
    max_whitespace: int | None = None
    # Picked by the engine's processor ("xgrammar" | "guidance"); not the user's to set.
    _backend: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()  # a pydantic model class
        elif isinstance(self.json, str):
            self.json = self._parse("json", self.json)
        if isinstance(self.structural_tag, str):
            self.structural_tag = self._parse("structural_tag", self.structural_tag)
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            given = f"got {set_kinds}" if set_kinds else "got none"
            raise ValueError(f"structured_outputs must set exactly one of {list(KINDS)}; {given}.")
        self._verify_types()

    @staticmethod
    def _parse(name: str, text: str) -> Any:
        try:
            return _json.loads(text)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{name} is not valid JSON: {e}") from None

    def _verify_types(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            text = repr(getattr(self, name))
            return ValueError(f"structured_outputs.{name} must be {allowed}, got {text[:40]}.")

        if self.json is not None and not isinstance(self.json, dict):
            raise bad("json", "a JSON schema (a dict, JSON text or a pydantic model class)")
        for name in ("regex", "grammar", "whitespace_pattern"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise bad(name, "a string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) for c in self.choice):
                raise bad("choice", "a non-empty list of strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad("json_object", "true or false")
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise bad("structural_tag", "a JSON object (a dict or JSON text)")
        if self.max_whitespace is not None and (isinstance(self.max_whitespace, bool)
                                                or not isinstance(self.max_whitespace, int) or self.max_whitespace < 0):
            raise bad("max_whitespace", "a non-negative integer or null")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def spec_text(self) -> str:
        """The constraint as text: the compile-cache key's spec, and what the limits measure."""
        kind = self.kind
        if kind in ("regex", "grammar"):
            return getattr(self, kind)
        if kind == "json_object":
            return ""
        return _json.dumps(getattr(self, kind))

    def options(self) -> tuple:
        """The settings besides the spec that change the compiled grammar (part of the cache key)."""
        return (self.disable_any_whitespace, self.disable_additional_properties, self.whitespace_pattern,
                self.max_whitespace)

    def check_limits(self, max_bytes: int, max_depth: int) -> None:
        """Refuse a constraint too large or too deeply nested to compile safely."""
        kind = self.kind
        size = len(self.spec_text().encode())
        if size > max_bytes:
            raise ValueError(f"structured_outputs.{kind} is {size} bytes, over the limit of {max_bytes} "
                             "(structured_outputs_config max_spec_bytes)")
        value = getattr(self, kind)
        if isinstance(value, (dict, list)):
            depth = _nesting_depth(value)
            if depth > max_depth:
                raise ValueError(f"structured_outputs.{kind} nests {depth} levels deep, over the limit of "
                                 f"{max_depth} (structured_outputs_config max_nesting_depth)")

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if not f.name.startswith("_") and getattr(self, f.name) != f.default]
        return f"StructuredOutputsParams({', '.join(shown)})"


@dataclass(repr=False)
class GuidedDecodingParams(StructuredOutputsParams):
    """The name vLLM used before 0.12 (``SamplingParams(guided_decoding=...)``), with its
    per-request ``backend``."""

    backend: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"guided_decoding.backend must be one of {list(BACKENDS)} or None, got "
                             f"{self.backend!r}.")
