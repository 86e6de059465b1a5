"""Tool-call parsers on the text each model family writes: the whole-text parse, and the same
text streamed in every two-piece split and in random chunkings, reassembled by the official
`openai` client's own stream accumulator, gives the same calls and content."""
from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager, import_tool_parser_plugin

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "lat": {"type": "number"}}}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]

# (parser, model text, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>', "Let me check.\n", [("get_weather", {"city": "Paris", "days": 3})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich {north}", "opts": {"a": [1, '
               '{"b": "}"}]}}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "",
     [("get_weather", {"city": "Zürich {north}", "opts": {"a": [1, {"b": "}"}]}}), ("now", {})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "now", "parameters": {}}', "", [("get_weather", {"city": "Oslo"}), ("now", {})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, '
                '{"name": "now", "arguments": {}}]', "Sure. ",
     [("get_weather", {"city": "Rome", "days": 2}), ("now", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]now[ARGS]{}', "",
     [("get_weather", {"city": "Rome"}), ("now", {})]),
    ("pythonic", '[get_weather(city="San José", days=4, hours=[1, 2]), now()]', "",
     [("get_weather", {"city": "San José", "days": 4, "hours": [1, 2]}), ("now", {})]),
    ("pythonic", '<|python_start|>[now()]<|python_end|>', "", [("now", {})]),
    ("qwen3_xml", 'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n'
                  '<parameter=days>\n5\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=lat>\n40.7\n'
                  '</parameter>\n<parameter=hours>\n[6, 18]\n</parameter>\n</function>\n</tool_call>', "Checking.\n",
     [("get_weather", {"city": "New York", "days": 5, "metric": True, "lat": 40.7, "hours": [6, 18]})]),
    ("qwen3_coder", '<tool_call>\n<function=now>\n</function>\n</tool_call>', "", [("now", {})]),
]
PLAIN = "The weather in Paris is mild; no tool is needed {really}."


def whole(name: str, text: str):
    return ToolParserManager.get_tool_parser(name)().extract_tool_calls(text, TOOLS)


def streamed(name: str, chunks: list[str]):
    """Feed the chunks as the server does, then reassemble with the openai client's accumulator."""
    from openai.lib.streaming.chat._completions import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    parser = ToolParserManager.get_tool_parser(name)()
    state = ChatCompletionStreamState()
    text, deltas = "", []
    for i, chunk in enumerate(chunks):
        text += chunk
        deltas.append(parser.extract_tool_calls_streaming(text, TOOLS, final=i == len(chunks) - 1))
    for delta in deltas + [None]:
        body = {} if delta is None else {"content": delta.content,
                                         "tool_calls": [c.model_dump(exclude_none=True) for c in delta.tool_calls] or None}
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": body, "finish_reason": "stop" if delta is None else None}]}))
    message = state.get_final_completion().choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments), c.id) for c in message.tool_calls or []]
    return message.content or "", calls


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_text_parse(name, text, content, calls):
    info = whole(name, text)
    assert info.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == calls
    assert (info.content or "") == content
    if name == "mistral":  # its templates take back only 9-character alphanumeric ids
        assert all(len(c.id) == 9 and c.id.isalnum() for c in info.tool_calls)
    else:
        assert all(c.id.startswith("call_") and c.type == "function" for c in info.tool_calls)
    assert len({c.id for c in info.tool_calls}) == len(calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_every_split_and_random_chunkings_reassemble_to_the_whole_parse(name, text, content, calls):
    rng = random.Random(0)
    chunkings = [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        chunkings.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for chunks in chunkings:
        got_content, got_calls = streamed(name, chunks)
        assert got_content == content, chunks
        assert [(n, a) for n, a, _ in got_calls] == calls, chunks
        assert all(i.startswith("call_") or (name == "mistral" and len(i) == 9) for _, _, i in got_calls)


@pytest.mark.parametrize("name", sorted({c[0] for c in CASES}))
def test_plain_text_is_content_whole_and_streamed(name):
    info = whole(name, PLAIN)
    assert not info.tools_called and info.content == PLAIN
    assert streamed(name, [PLAIN[i:i + 5] for i in range(0, len(PLAIN), 5)]) == (PLAIN, [])


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'),
    ("hermes", '<tool_call>not json</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": [1, 2]}'),
    ("llama3_json", '{"oops": 1}'),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": "x"}]'),
    ("pythonic", '[get_weather(city=open("/etc/passwd").read())]'),
    ("pythonic", '[1, 2, 3]'),
    ("qwen3_xml", '<tool_call>\n<function=now>\n'),
])
def test_malformed_calls_fall_back_to_content(name, text):
    info = whole(name, text)
    assert not info.tools_called and info.content == text


def test_pythonic_never_evaluates_code(tmp_path):
    marker = tmp_path / "ran"
    info = whole("pythonic", f'[now(x=__import__("pathlib").Path("{marker}").touch())]')
    assert not info.tools_called and not marker.exists()


def test_unknown_parser_names_the_available_ones():
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'.*hermes.*llama3_json.*mistral"):
        ToolParserManager.get_tool_parser("nope")


def test_plugin_file_registers_a_parser(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager\n"
        "from pagedllm.entrypoints.openai.tool_parsers.base import ParsedText, PartialCall, ToolParser\n"
        "@ToolParserManager.register_module('call_colon')\n"
        "class CallColon(ToolParser):\n"
        "    def parse(self, text, tools=None, final=True):\n"
        "        if not text.startswith('CALL:'):\n"
        "            return ParsedText(content=text)\n"
        "        name, _, args = text[5:].partition(' ')\n"
        "        return ParsedText(calls=[PartialCall(name=name, args_text=args, complete=True)])\n")
    import_tool_parser_plugin(str(plugin))
    info = whole("call_colon", 'CALL:now {"tz": "UTC"}')
    assert info.tools_called and info.tool_calls[0].function.name == "now"
    assert json.loads(info.tool_calls[0].function.arguments) == {"tz": "UTC"}
    with pytest.raises(ValueError, match="not a file"):
        import_tool_parser_plugin(str(tmp_path / "missing.py"))
