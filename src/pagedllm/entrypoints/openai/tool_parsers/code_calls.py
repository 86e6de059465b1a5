"""Tool calls written as code or markup: pythonic (``[f(a=1), g()]``) and Qwen3-Coder's XML."""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedText, PartialCall, ToolParser, ToolParserManager, held_back,
)


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    """A Python list of calls with literal keyword arguments, ``[get_weather(city="Paris"),
    now()]`` (Llama 3.2/4, ToolACE); optionally inside ``<|python_start|>...<|python_end|>``.
    Parsed with ``ast`` (never evaluated); a call goes out once the whole list parses."""

    start, end = "<|python_start|>", "<|python_end|>"

    def parse(self, text: str, tools: Optional[list[dict]] = None, final: bool = True) -> ParsedText:
        body = text.strip()
        tagged = body.startswith(self.start)
        if tagged:
            body = body[len(self.start):].removesuffix(self.end).strip()
        if not final and (self.start.startswith(body) or (tagged and not body)):
            return ParsedText()  # the start tag still being written, or the list not begun yet
        if not body.startswith("["):
            return ParsedText(content=text)
        try:
            calls = _literal_calls(ast.parse(body, mode="eval").body)
        except (SyntaxError, ValueError):
            # Unfinished (more text to come) or not a call list (then it is plain content).
            return ParsedText() if not final else ParsedText(malformed=True)
        return ParsedText(calls=[PartialCall(name=name, args_text=json.dumps(args, ensure_ascii=False),
                                             complete=True) for name, args in calls])


def _literal_calls(node: ast.AST) -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(node, ast.List) or not node.elts:
        raise ValueError("not a list of calls")
    out = []
    for call in node.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            raise ValueError("each element must be name(keyword=literal, ...)")
        out.append((call.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}))
    return out


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


@ToolParserManager.register_module("qwen3_xml", "qwen3_coder")
class Qwen3XMLToolParser(ToolParser):
    """Qwen3-Coder / Qwen3.5: ``<tool_call><function=NAME><parameter=ARG>value</parameter>...
    </function></tool_call>``. Values are text; each is converted by the type the tool's JSON
    schema gives its parameter. A call's arguments go out whole, when its function closes."""

    starts = ("<tool_call>", "<function=")

    def parse(self, text: str, tools: Optional[list[dict]] = None, final: bool = True) -> ParsedText:
        hits = [i for i in (text.find(s) for s in self.starts) if i >= 0]
        if not hits:
            keep = len(text) if final else len(text) - held_back(text, self.starts)
            return ParsedText(content=text[:keep])
        first = min(hits)
        out = ParsedText(content=text[:first])
        for match in _FUNCTION.finditer(text, first):
            name, body, closed = match.group(1).strip(), match.group(2), bool(match.group(3))
            if not closed:
                out.calls.append(PartialCall(name=name))
                break
            schema = _parameter_schemas(tools, name)
            args = {key.strip(): _convert(_strip_newline(value), schema.get(key.strip(), {}))
                    for key, value in _PARAMETER.findall(body)}
            out.calls.append(PartialCall(name=name, args_text=json.dumps(args, ensure_ascii=False), complete=True))
        if not out.calls and final:
            out.malformed = True
        return out


def _strip_newline(value: str) -> str:
    """The template writes each value on its own lines: one newline each side is layout."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _parameter_schemas(tools: Optional[list[dict]], name: str) -> dict[str, dict]:
    for tool in tools or []:
        function = tool.get("function", tool)
        if function.get("name") == name:
            return (function.get("parameters") or {}).get("properties") or {}
    return {}


def _convert(value: str, schema: dict) -> Any:
    """A parameter's text as the JSON type its schema declares (text as is when unsure)."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    try:
        if "integer" in kinds:
            return int(value.strip())
        if "number" in kinds:
            number = float(value.strip())
            return int(number) if number.is_integer() and "." not in value else number
        if "boolean" in kinds:
            lowered = value.strip().lower()
            if lowered in ("true", "false"):
                return lowered == "true"
        if "null" in kinds and value.strip().lower() in ("null", "none"):
            return None
        if kind is None or "object" in kinds or "array" in kinds:
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                return ast.literal_eval(value.strip()) if kind is not None else value
    except (ValueError, SyntaxError):
        pass
    return value
