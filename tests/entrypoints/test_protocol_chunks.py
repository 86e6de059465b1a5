"""The streamed chunks the server builds as dicts (one per token, no pydantic validation on that
path) are exactly the pydantic models' dumps they replace: every field, in order, logprobs,
stop reasons of both types, non-ASCII text, a delta carrying only what it sets."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionChunk, ChatLogprobs, ChatStreamChoice, ChatTokenLogprob, ChatTopLogprob, CompletionChoice,
    CompletionLogprobs, CompletionResponse, DeltaMessage, UsageInfo, chat_chunk, chat_stream_choice,
    completion_chunk,
)

LOGPROBS = CompletionLogprobs(text_offset=[0, 1], token_logprobs=[-0.5, None], tokens=["é", "\n"],
                              top_logprobs=[{"é": -0.5}, None])


@pytest.mark.parametrize("logprobs, finish_reason, stop_reason", [(None, None, None), (LOGPROBS, "stop", 7),
                                                                   (None, "length", "</s>")])
def test_completion_chunk_is_the_models_dump(logprobs, finish_reason, stop_reason):
    want = CompletionResponse(id="cmpl-1", created=5, model="m", choices=[CompletionChoice(
        index=2, text='é\n"x', logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)])
    got = completion_chunk("cmpl-1", 5, "m", 2, 'é\n"x', logprobs, finish_reason, stop_reason)
    assert got == want.model_dump() and list(got) == list(want.model_dump())
    assert json.loads(json.dumps(got)) == json.loads(want.model_dump_json())


@pytest.mark.parametrize("with_usage", [False, True])
def test_chat_chunk_is_the_models_dump_with_a_delta_of_what_it_sets(with_usage):
    delta = DeltaMessage(content="hé", tool_calls=[{"index": 0, "function": {"name": "f", "arguments": None}}])
    logprobs = ChatLogprobs(content=[ChatTokenLogprob(token="h", logprob=-1.0, bytes=[104],
                                                      top_logprobs=[ChatTopLogprob(token="h", logprob=-1.0)])])
    usage = UsageInfo(prompt_tokens=3, completion_tokens=4, total_tokens=7) if with_usage else None
    want = ChatCompletionChunk(id="chat-1", created=5, model="m", usage=usage, choices=[
        ChatStreamChoice(index=1, delta=delta, logprobs=logprobs, finish_reason="tool_calls", stop_reason=None),
        ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))]).model_dump()
    for choice in want["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    got = chat_chunk("chat-1", 5, "m", [chat_stream_choice(1, delta, logprobs, "tool_calls", None),
                                        chat_stream_choice(0, DeltaMessage(role="assistant", content=""))], usage)
    assert got == want and [list(c) for c in got["choices"]] == [list(c) for c in want["choices"]]
    assert got["choices"][0]["delta"] == {"content": "hé", "tool_calls": [{"index": 0, "function": {
        "name": "f", "arguments": None}}]} and got["choices"][1]["delta"] == {"role": "assistant", "content": ""}
