"""``tool_choice`` "required" and a named function: structured outputs force the call.

As vLLM does, the output is constrained by a JSON schema built from the request's tools:
a named function's output is its arguments object (the function's ``parameters`` schema);
"required" writes a JSON array of ``{"name": ..., "parameters": {...}}`` objects, each one
of the tools (one element at most when ``parallel_tool_calls`` is false). The parsers below
read those outputs back into OpenAI tool calls, whole or streamed (name first, then the
arguments' text in fragments), through the same ``ToolParser`` contract as the model
families' parsers.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from pagedllm.entrypoints.openai.protocol import BadParam
from pagedllm.entrypoints.openai.tool_parsers.base import ParsedText, PartialCall, ToolParser, json_prefix
from pagedllm.entrypoints.openai.tool_parsers.json_calls import json_call_sequence
from pagedllm.structured_params import StructuredOutputsParams

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Whitespace characters allowed between a forced call's JSON tokens: room for any indentation
# a model writes, while a model that loops on newlines ends its call instead of its max_tokens.
FORCED_CALL_MAX_WHITESPACE = 16


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or _ANY_OBJECT


def forced_call_schema(tools: list[dict], choice: Any, parallel_tool_calls: Optional[bool]) -> dict:
    """The JSON schema that forces a call: a named function's arguments, or for "required" an
    array of calls to any of the tools."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return next(_parameters(t) for t in tools if t["function"]["name"] == name)
    items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": _parameters(t)}} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def forced_call_constraint(tools: list[dict], choice: Any, parallel_tool_calls: Optional[bool],
                           other: Optional[StructuredOutputsParams]) -> StructuredOutputsParams:
    """The request's constraint for a forced call; a request that also constrains its output
    otherwise (response_format, guided_*) asks for two things at once: a 400."""
    if other is not None:
        raise BadParam("tool_choice", "tool_choice 'required' or a named function constrains the output to a tool "
                                      "call; it cannot be combined with response_format / structured outputs")
    try:
        return StructuredOutputsParams(json=forced_call_schema(tools, choice, parallel_tool_calls),
                                       max_whitespace=FORCED_CALL_MAX_WHITESPACE)
    except (TypeError, ValueError) as e:
        raise BadParam("tools", f"tools: a function's parameters schema cannot force a call: {str(e)[:300]}") \
            from None


class NamedCallParser(ToolParser):
    """The output is the named function's arguments object, nothing else."""

    def __init__(self, tokenizer: Any = None, name: str = "") -> None:
        super().__init__(tokenizer)
        self.name = name

    def parse(self, text: str, tools: Optional[list[dict]] = None, final: bool = True) -> ParsedText:
        args = json_prefix(text)
        try:
            json.loads(args)
            complete = True
        except json.JSONDecodeError:
            complete = False
        return ParsedText(calls=[PartialCall(name=self.name, args_text=args, complete=complete)])


class RequiredCallsParser(ToolParser):
    """The output is a JSON array of ``{"name": ..., "parameters": {...}}`` calls."""

    def parse(self, text: str, tools: Optional[list[dict]] = None, final: bool = True) -> ParsedText:
        start = text.find("[")
        if start < 0:
            return ParsedText()
        calls, malformed, _ = json_call_sequence(text, start + 1, ",")
        return ParsedText(calls=calls, malformed=malformed)


def forced_call_parser(choice: Any, tokenizer: Any) -> ToolParser:
    if isinstance(choice, dict):
        return NamedCallParser(tokenizer, choice["function"]["name"])
    return RequiredCallsParser(tokenizer)
