"""The tool-call parser contract: whole-text extraction, streamed deltas, a registry by name."""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pydantic import BaseModel, Field

from pagedllm.utils import held_back  # noqa: F401  (the parsers' shared helper)


def make_tool_call_id() -> str:
    """An id shaped like OpenAI's (``call_`` + 24 random characters)."""
    return "call_" + secrets.token_hex(12)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (the OpenAI wire shape)


class ToolCall(BaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    index: int
    id: Optional[str] = None
    type: Optional[str] = None
    function: DeltaFunctionCall


class ExtractedToolCallInformation(BaseModel):
    tools_called: bool
    tool_calls: list[ToolCall] = Field(default_factory=list)
    content: Optional[str] = None


class ToolDelta(BaseModel):
    """What one streamed step adds: content text, and/or tool-call fragments."""

    content: Optional[str] = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


@dataclass
class PartialCall:
    """A call as far as the text shows it. ``args_text`` only ever grows by appending (each
    value is a prefix of the final one), so its growth can be streamed as fragments."""

    name: Optional[str] = None  # None until the whole name has been written
    args_text: str = ""  # the arguments JSON so far (raw text, or the whole JSON once complete)
    complete: bool = False


@dataclass
class ParsedText:
    """The model output split into plain content and calls. ``content`` is prefix-stable too:
    text that may still turn out to start a call (``"<tool_"``) is held back."""

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)
    malformed: bool = False  # a complete call whose text does not parse: the output is content


def json_prefix(text: str) -> str:
    """The part of ``text`` (which starts a JSON value) that belongs to that value: the whole
    value once it is complete (its end found by the decoder), else all of it (an unfinished
    value owns every character written so far)."""
    text = text.lstrip()
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return text
    return text[:end]


def normalize_arguments(args_text: str) -> Optional[str]:
    """The arguments as compact JSON text, or None when they are not a JSON object."""
    try:
        value = json.loads(args_text) if args_text.strip() else {}
    except json.JSONDecodeError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class ToolParser:
    """One model family's tool-call text format. A parser implements ``parse`` (the text so
    far → content and partial calls); whole-text extraction and streaming derive from it.
    One instance per request: streaming keeps what has been sent."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._sent_content = 0
        self._sent: list[dict[str, Any]] = []  # per call: id, whether the name went out, args sent

    @staticmethod
    def make_id() -> str:
        """A new tool call's id (the family's chat template must accept it back)."""
        return make_tool_call_id()

    def parse(self, text: str, tools: Optional[list[dict]] = None, final: bool = True) -> ParsedText:
        """``final``: the text is the whole output (nothing is held back for text still to come)."""
        raise NotImplementedError

    # -- whole text -------------------------------------------------------------------------------
    def extract_tool_calls(self, model_output: str, tools: Optional[list[dict]] = None
                           ) -> ExtractedToolCallInformation:
        parsed = self.parse(model_output, tools)
        calls = []
        for call in parsed.calls:
            args = normalize_arguments(call.args_text) if call.complete else None
            if call.name is None or args is None:
                return ExtractedToolCallInformation(tools_called=False, content=model_output)
            calls.append(ToolCall(id=self.make_id(), function=FunctionCall(name=call.name, arguments=args)))
        if parsed.malformed or not calls:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=parsed.content or None)

    # -- streaming --------------------------------------------------------------------------------
    def extract_tool_calls_streaming(self, current_text: str, tools: Optional[list[dict]] = None,
                                     final: bool = False) -> Optional[ToolDelta]:
        """What ``current_text`` (everything generated so far) adds to what was already sent.
        The tool-call deltas follow OpenAI's shape: index, id and name first, then argument
        fragments whose concatenation is the call's arguments JSON. Call it with ``final=True``
        once the output is complete: text held back as a possible call start comes out then."""
        parsed = self.parse(current_text, tools, final)
        content = parsed.content[self._sent_content:] if len(parsed.content) > self._sent_content else ""
        self._sent_content = max(self._sent_content, len(parsed.content))
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(parsed.calls):
            if index == len(self._sent):
                if call.name is None:
                    break  # its name is not whole yet: nothing of it goes out
                self._sent.append({"id": self.make_id(), "args": 0})
                deltas.append(DeltaToolCall(index=index, id=self._sent[index]["id"], type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments="")))
            sent = self._sent[index]
            if len(call.args_text) > sent["args"]:
                fragment = call.args_text[sent["args"]:]
                sent["args"] = len(call.args_text)
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
        if not content and not deltas:
            return None
        return ToolDelta(content=content or None, tool_calls=deltas)


class ToolParserManager:
    """Parsers by name (``--tool-call-parser NAME``); plugins register themselves on import."""

    parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, *names: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"{parser!r} is not a ToolParser subclass")
            for name in names:
                cls.parsers[name] = parser
            return parser

        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.parsers:
            raise ValueError(f"unknown tool call parser {name!r}; available: {sorted(cls.parsers)}")
        return cls.parsers[name]


def import_tool_parser_plugin(path: str) -> None:
    """Run a Python file that registers parsers (``--tool-parser-plugin FILE``)."""
    if not os.path.isfile(path):
        raise ValueError(f"tool parser plugin {path!r} is not a file")
    name = "pagedllm_tool_parser_plugin_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"tool parser plugin {path!r} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
