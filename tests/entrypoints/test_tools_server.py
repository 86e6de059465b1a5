"""Tools and reasoning on the server: vLLM's tool_choice rules and errors on a real `pagedllm serve`
(official `openai` client), tool definitions reaching the chat template, the parser flags checked
before the model loads, and the chat handler's parsers giving the same message whole and streamed."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedllm.entrypoints.openai.cli_args import FrontendArgs
from pagedllm.reasoning import ReasoningParserManager
from pagedllm.entrypoints.openai.serving_chat import ChoiceParsers
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
from tests.entrypoints.test_openai_server import MODEL_NAME, _serve

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS_TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}: {{ t.function.description }}]{% endfor %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")


@pytest.fixture(scope="module")
def url(tiny_models, tmp_path_factory):
    """A server with a reasoning parser but without --enable-auto-tool-choice."""
    log_path = tmp_path_factory.mktemp("tools-server") / "server.log"
    yield from _serve(tiny_models["llama"], log_path, ["--served-model-name", MODEL_NAME, "--disable-log-stats",
                                                        "--reasoning-parser", "qwen3"], {"PAGEDLLM_API_KEY": ""})


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("tool_choice, match", [
    (None, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),  # tools: auto
    ("auto", '"auto" tool choice requires --enable-auto-tool-choice'),
    ({"type": "function", "function": {"name": "launch_rockets"}}, "'launch_rockets', which is not among"),
    ("sometimes", "tool_choice must be 'none', 'auto', 'required' or a named function"),
])
def test_tool_choice_errors_are_400_naming_the_field_and_the_server_serves_on(client, tool_choice, match):
    kwargs = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError, match=match) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[TOOL], max_tokens=2, **kwargs)
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="`tools` must be set"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tool_choice="auto", max_tokens=2)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


def test_tool_choice_none_answers_in_text_and_the_template_sees_the_tools(client, url):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[TOOL], tool_choice="none",
                                           max_tokens=3, temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
    body = {"messages": MESSAGES, "chat_template": TOOLS_TEMPLATE}
    with_tools = httpx.post(f"{url}/tokenize", json=body | {"tools": [TOOL]}).json()
    without = httpx.post(f"{url}/tokenize", json=body).json()
    assert with_tools["count"] > without["count"]
    detok = httpx.post(f"{url}/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    assert detok.startswith("[tool get_weather: Weather of a city]user: Weather in Paris?")


def test_reasoning_parser_leaves_untagged_replies_as_content_whole_and_streamed(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert getattr(whole.choices[0].message, "reasoning_content", None) is None


def test_parser_flags_fail_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        FrontendArgs(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool call parser 'herms'.*hermes"):
        FrontendArgs(tool_call_parser="herms")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        FrontendArgs(reasoning_parser="o1")
    with pytest.raises(ValueError, match="not a file"):
        FrontendArgs(tool_parser_plugin=str(tmp_path / "none.py"))
    assert FrontendArgs(enable_auto_tool_choice=True, tool_call_parser="hermes").tool_call_parser == "hermes"


REPLY = ('<think>\nThe user wants the weather; call the tool.\n</think>\n\nChecking.<tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_chat_handler_parsers_give_the_same_message_whole_and_streamed():
    def parsers():
        return ChoiceParsers(ReasoningParserManager.get_reasoning_parser("qwen3"),
                             ToolParserManager.get_tool_parser("hermes"), None, [TOOL])

    message, finish = parsers().whole(REPLY, "assistant", "stop")
    assert finish == "tool_calls" and message.content == "\n\nChecking."
    assert message.reasoning_content == "\nThe user wants the weather; call the tool.\n"
    (call,) = message.tool_calls
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    for size in (1, 3, 7, 50):
        streaming, text, reasoning, content, args = parsers(), "", "", "", ""
        pieces = [REPLY[i:i + size] for i in range(0, len(REPLY), size)]
        for i, piece in enumerate(pieces):
            text += piece
            delta = streaming.delta(text, piece, final=i == len(pieces) - 1)
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            for c in delta.tool_calls or []:
                args += c["function"].get("arguments") or ""
        assert (reasoning, content) == (message.reasoning_content, message.content) and streaming.called
        assert json.loads(args) == {"city": "Paris"}
