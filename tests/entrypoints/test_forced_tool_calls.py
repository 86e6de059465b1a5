"""tool_choice "required" and a named function on a real `pagedllm serve` (official `openai`
client): structured outputs force the call, so a random-weight model's noise comes back as
calls whose arguments validate against their function's schema, whole and streamed."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagedllm.entrypoints.openai.tool_choice import NamedCallParser, RequiredCallsParser, forced_call_schema
from tests.entrypoints.test_openai_server import MODEL_NAME, _serve
from tests.entrypoints.test_server_limits import _grammar_accepts_prefix

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99}, "b": {"type": "integer", "minimum": 0,
                                                                       "maximum": 9}}}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def url(tiny_models, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("forced-tools-server") / "server.log"
    yield from _serve(tiny_models["llama"], log_path, ["--served-model-name", MODEL_NAME, "--disable-log-stats",
                                                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                      {"PAGEDLLM_API_KEY": ""})


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def nothing_left(url):
    yield
    stats = httpx.get(f"{url}/internal/stats").json()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def _check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# A finite language (bounded strings, integers and whitespace runs, one call): this many tokens
# hold its longest member, so every reply must end with its call.
FINITE_MAX_TOKENS = 320


def test_a_named_function_returns_its_call_with_valid_arguments(client):
    named = {"type": "function", "function": {"name": "add"}}
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                           max_tokens=FINITE_MAX_TOKENS, n=3, seed=1)
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and not choice.message.content  # OpenAI's shape for a forced name
        _check_calls(choice.message.tool_calls, {"add"})
        assert len(choice.message.tool_calls) == 1


def test_required_returns_calls_of_the_tools_with_valid_arguments(client):
    single = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=FINITE_MAX_TOKENS, n=3, seed=3)
    for choice in single.choices:
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        _check_calls(choice.message.tool_calls, {"get_weather", "add"})
        assert len(choice.message.tool_calls) == 1
    # Parallel calls: an array of any length (an infinite language), so a reply may be cut by
    # max_tokens; a cut reply is text that the forced schema's grammar still accepts as a prefix.
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=400, n=3, seed=2)
    finished = [c for c in reply.choices if c.finish_reason == "tool_calls"]
    assert finished and any(len(c.message.tool_calls) > 1 for c in finished)
    for choice in reply.choices:
        if choice.finish_reason == "tool_calls":
            _check_calls(choice.message.tool_calls, {"get_weather", "add"})
        else:
            assert choice.finish_reason == "length"
            assert _grammar_accepts_prefix(choice.message.content, forced_call_schema(TOOLS, "required", None))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_forced_calls_reassemble_to_the_whole_reply(client, tool_choice):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, seed=4,
                  parallel_tool_calls=False, max_tokens=FINITE_MAX_TOKENS)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] = call["name"] or delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason
    assert [c["name"] for c in calls.values()] == [c.function.name for c in whole.message.tool_calls]
    for streamed, call in zip(calls.values(), whole.message.tool_calls):
        assert streamed["id"].startswith("call_")
        assert json.loads(streamed["arguments"]) == json.loads(call.function.arguments)
        jsonschema.validate(json.loads(streamed["arguments"]), SCHEMAS[streamed["name"]])


@pytest.mark.parametrize("extra, param, match", [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope', which is not"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}]}, None, ""),
])
def test_bad_forced_calls_are_400_and_the_server_serves_on(url, extra, param, match):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 5, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in (param, "tools", None) and match in r.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


CONVERSATION_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %} call {{ c.id }} "
    "{{ c.function.name }}({{ c.function.arguments }}){% endfor %}{% endif %}"
    "{% if m.tool_call_id %} result of {{ m.tool_call_id }}:{% endif %} {{ m.content or '' }}\n{% endfor %}assistant:")


def test_tool_results_go_back_through_the_template(client, url):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                           max_tokens=FINITE_MAX_TOKENS, seed=5)
    (call,) = reply.choices[0].message.tool_calls
    conversation = MESSAGES + [reply.choices[0].message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=conversation, tools=TOOLS, tool_choice="none",
                                            max_tokens=3)
    assert answer.choices[0].finish_reason == "length"
    body = {"messages": conversation, "tools": TOOLS, "chat_template": CONVERSATION_TEMPLATE}
    prompt = httpx.post(f"{url}/detokenize", json={"tokens": httpx.post(f"{url}/tokenize", json=body).json()[
        "tokens"]}).json()["prompt"]
    assert f"assistant: call {call.id} get_weather({call.function.arguments})" in prompt
    assert f"tool: result of {call.id}: sunny, 21 C" in prompt


REQUIRED_TEXT = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                 '{"name": "add", "parameters": {"a": -2, "b": 3}}]')


@pytest.mark.parametrize("size", [1, 4, 11])
def test_forced_call_parsers_stream_the_arguments_text_exactly(size):
    for parser_cls, text, expected in (
            (RequiredCallsParser, REQUIRED_TEXT, [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                                  ("add", {"a": -2, "b": 3})]),
            (lambda: NamedCallParser(None, "add"), '{"a": 1, "b": 2}', [("add", {"a": 1, "b": 2})])):
        whole = parser_cls().extract_tool_calls(text)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == expected
        streaming, so_far, calls = parser_cls(), "", {}
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            so_far += piece
            delta = streaming.extract_tool_calls_streaming(so_far, None, final=i == len(pieces) - 1)
            for c in (delta.tool_calls if delta else []):
                entry = calls.setdefault(c.index, [c.function.name, ""])
                entry[1] += c.function.arguments or ""
        assert [(n, json.loads(a)) for n, a in calls.values()] == expected
