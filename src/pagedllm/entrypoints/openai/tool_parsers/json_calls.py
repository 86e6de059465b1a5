"""Tool calls written as JSON objects: hermes (Qwen2.5/Qwen3), llama3_json, mistral."""
from __future__ import annotations

import json
import re
import secrets
import string
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedText, PartialCall, ToolParser, ToolParserManager, held_back, json_prefix,
)

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def json_call(body: str) -> tuple[PartialCall, bool]:
    """One call object ``{"name": ..., "arguments": {...}}`` as far as ``body`` shows it; the
    second value says the body is a complete object that is not a valid call."""
    name_match = _NAME.search(body)
    name = json.loads(f'"{name_match.group(1)}"') if name_match else None
    args_match = _ARGS.search(body)
    args_text = json_prefix(body[args_match.end():]) if args_match else ""
    try:
        obj, _ = json.JSONDecoder().raw_decode(body.lstrip())
    except json.JSONDecodeError:
        return PartialCall(name=name, args_text=args_text), False
    valid = isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(
        obj.get("arguments", obj.get("parameters", {})), dict)
    if valid and not args_match:
        args_text = "{}"
    return PartialCall(name=obj.get("name") if valid else name, args_text=args_text, complete=True), not valid


def json_call_sequence(text: str, pos: int, separators: str) -> tuple[list[PartialCall], bool, int]:
    """Call objects one after another from ``pos`` (``separators`` between them); stops at the
    first character that starts no object. Returns the calls, whether one is malformed, and
    where parsing stopped."""
    calls, malformed, decoder = [], False, json.JSONDecoder()
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            return calls, malformed, pos
        try:
            _, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            call, _ = json_call(text[pos:])
            return calls + [call], malformed, len(text)
        call, bad = json_call(text[pos:end])
        calls.append(call)
        malformed |= bad
        pos = end


@ToolParserManager.register_module("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, after
    optional plain text (Qwen2.5, Qwen3, Hermes 2/3)."""

    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, tools: Optional[list[dict]] = None, final: bool = True) -> ParsedText:
        first = text.find(self.start)
        if first < 0:
            keep = len(text) if final else len(text) - held_back(text, (self.start,))
            return ParsedText(content=text[:keep])
        out = ParsedText(content=text[:first])
        pos = first
        while pos >= 0:
            body_start = pos + len(self.start)
            close = text.find(self.end, body_start)
            call, bad = json_call(text[body_start:close if close >= 0 else len(text)])
            if close >= 0 and not call.complete:
                bad = True  # the block closed around something that is not one JSON object
            out.calls.append(call)
            out.malformed |= bad
            if close < 0:
                break
            pos = text.find(self.start, close + len(self.end))
        return out


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the whole reply is ``{"name": ..., "parameters": {...}}`` (after an
    optional ``<|python_tag|>``), several separated by ``;``."""

    tag = "<|python_tag|>"

    def parse(self, text: str, tools: Optional[list[dict]] = None, final: bool = True) -> ParsedText:
        stripped = text.lstrip()
        tagged = stripped.startswith(self.tag)
        if tagged:
            stripped = stripped[len(self.tag):].lstrip()
        if not final and (self.tag.startswith(stripped) or (tagged and not stripped)):
            return ParsedText()  # the tag still being written, or the call not begun yet
        if not stripped.startswith("{"):
            return ParsedText(content=text)
        calls, malformed, stop = json_call_sequence(stripped, 0, ";")
        return ParsedText(calls=calls, malformed=malformed or bool(stripped[stop:].strip()))


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B v0.3, Nemo) and the
    newer ``[TOOL_CALLS]name[ARGS]{...}`` per call (Mistral Small 3.2, Magistral)."""

    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"

    @staticmethod
    def make_id() -> str:
        """Mistral's templates accept only 9-character alphanumeric tool call ids."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def parse(self, text: str, tools: Optional[list[dict]] = None, final: bool = True) -> ParsedText:
        first = text.find(self.marker)
        if first < 0:
            keep = len(text) if final else len(text) - held_back(text, (self.marker,))
            return ParsedText(content=text[:keep])
        out = ParsedText(content=text[:first])
        rest = text[first + len(self.marker):]
        if rest.lstrip().startswith("["):  # the JSON-array form
            pos = rest.index("[") + 1
            out.calls, out.malformed, _ = json_call_sequence(rest, pos, ",")
            return out
        for chunk in rest.split(self.marker):  # name[ARGS]{...} per call
            if self.args_marker not in chunk:
                if chunk.strip():
                    out.calls.append(PartialCall())  # a name still being written
                break
            name, args = chunk.split(self.args_marker, 1)
            args_text = json_prefix(args)
            try:
                value, end = json.JSONDecoder().raw_decode(args.lstrip())
                complete = True
            except json.JSONDecodeError:
                value, complete = None, False
            out.calls.append(PartialCall(name=name.strip(), args_text=args_text, complete=complete))
            out.malformed |= complete and not isinstance(value, dict)
        return out
