"""Tool-call parsers by name (``--tool-call-parser NAME``): model text → OpenAI ``tool_calls``.

How the server uses them (one parser instance per request and choice):

- whole response: ``info = parser.extract_tool_calls(text, request_tools)``; when
  ``info.tools_called`` the message carries ``info.tool_calls`` (ids included) and
  ``info.content``, and ``finish_reason`` is ``"tool_calls"``; otherwise the text is content.
- streaming: after each engine output, ``delta = parser.extract_tool_calls_streaming(text_so_far,
  request_tools)``, and once more with ``final=True`` when the request ends; a non-None delta
  becomes a chunk's ``delta.content`` / ``delta.tool_calls`` (index, id, type and name first, then
  argument fragments that the official client concatenates).
"""
from pagedllm.entrypoints.openai.tool_parsers import code_calls, json_calls  # noqa: F401 (they register)
from pagedllm.entrypoints.openai.tool_parsers.base import (
    DeltaFunctionCall, DeltaToolCall, ExtractedToolCallInformation, FunctionCall, ToolCall, ToolDelta, ToolParser,
    ToolParserManager, import_tool_parser_plugin,
)

__all__ = ["DeltaFunctionCall", "DeltaToolCall", "ExtractedToolCallInformation", "FunctionCall", "ToolCall",
           "ToolDelta", "ToolParser", "ToolParserManager", "import_tool_parser_plugin"]
