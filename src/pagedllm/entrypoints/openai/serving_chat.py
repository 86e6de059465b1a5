"""/v1/chat/completions: messages through the chat template, replies (whole or streamed) out."""
from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.entrypoints.openai.protocol import (
    BadParam, ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatResponseMessage,
    ChatTokenLogprob, ChatTopLogprob, DeltaMessage, UsageInfo, chat_chunk, chat_stream_choice,
)
from pagedllm.reasoning import ReasoningParser, ReasoningParserManager
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, _MIN_LOGPROB, _merge, _sse
from pagedllm.entrypoints.openai.tool_choice import forced_call_constraint, forced_call_parser
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class ChoiceParsers:
    """One reply's reasoning and tool-call parsers: whole text, or streamed deltas."""

    def __init__(self, reasoning_cls: Optional[type[ReasoningParser]], tool_cls: Optional[type[ToolParser]],
                 tokenizer: Any, tools: Optional[list[dict]], forced: Any = None) -> None:
        self.reasoning = reasoning_cls(tokenizer) if reasoning_cls else None
        # tool_choice "required" / a named function (``forced``): the constrained output's own parser.
        self.tool = forced_call_parser(forced, tokenizer) if forced is not None \
            else tool_cls(tokenizer) if tool_cls else None
        self.tools = tools
        # OpenAI's finish_reason: "tool_calls" when the model chose to call, "stop" for a named function.
        self.call_finish_reason = "stop" if isinstance(forced, dict) else "tool_calls"
        self.content = ""  # the reply past the reasoning, so far (what the tool parser reads)
        self.called = False

    def finish_reason(self, finish_reason: Optional[str]) -> Optional[str]:
        """A streamed reply's finish reason, once its calls went out."""
        return self.call_finish_reason if self.called and finish_reason == "stop" else finish_reason

    def whole(self, text: str, role: str, finish_reason: Optional[str]) -> tuple[ChatResponseMessage, Optional[str]]:
        reasoning, content = self.reasoning.extract_reasoning_content(text) if self.reasoning else (None, text)
        calls = None
        if self.tool is not None and content:
            info = self.tool.extract_tool_calls(content, self.tools)
            if info.tools_called:
                calls, content = [c.model_dump() for c in info.tool_calls], info.content
                finish_reason = self.call_finish_reason if finish_reason == "stop" else finish_reason
        message = ChatResponseMessage(role=role, content=content, tool_calls=calls, reasoning_content=reasoning,
                                      reasoning=reasoning)
        return message, finish_reason

    def delta(self, text_so_far: str, new_text: str, final: bool) -> DeltaMessage:
        reasoning = None
        content = new_text
        if self.reasoning is not None:
            step = self.reasoning.extract_reasoning_content_streaming(text_so_far, final)
            reasoning, content = (step.reasoning_content, step.content) if step else (None, None)
        if self.tool is None:
            return DeltaMessage(content=content, reasoning_content=reasoning, reasoning=reasoning)
        self.content += content or ""
        step = self.tool.extract_tool_calls_streaming(self.content, self.tools, final)
        calls = [c.model_dump(exclude_none=True) for c in step.tool_calls] if step and step.tool_calls else None
        self.called |= calls is not None
        return DeltaMessage(content=step.content if step else None, tool_calls=calls, reasoning_content=reasoning,
                            reasoning=reasoning)


class OpenAIServingChat(OpenAIServing):
    """The chat completions handler."""

    def __init__(self, *args: Any, enable_auto_tool_choice: bool = False, tool_call_parser: Optional[str] = None,
                 reasoning_parser: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_cls = ToolParserManager.get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_cls = ReasoningParserManager.get_reasoning_parser(reasoning_parser) if reasoning_parser else None

    def parsers(self, req: ChatCompletionRequest) -> ChoiceParsers:
        """vLLM's tool_choice rules: tools without a tool_choice mean "auto", which needs the
        server's --enable-auto-tool-choice; "none" leaves the reply as text; "required" and a
        named function are forced by a constraint (``forced_call_constraint``)."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise BadParam("tool_choice", "When using `tool_choice`, `tools` must be set.")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if choice.get("type") != "function" or name not in {t["function"]["name"] for t in tools}:
                raise BadParam("tool_choice", f"tool_choice names function {str(name)[:64]!r}, which is not "
                                              f"among the request's tools")
        elif choice not in ("none", "auto", "required"):
            raise BadParam("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                                          f"got {str(choice)[:64]!r}")
        if choice == "auto" and not self.enable_auto_tool_choice:
            raise BadParam("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and '
                                          '--tool-call-parser to be set')
        tool_cls = self.tool_cls if choice == "auto" else None
        forced = choice if choice == "required" or isinstance(choice, dict) else None
        return ChoiceParsers(self.reasoning_cls, tool_cls, self.tokenizer, tools, forced)

    def sampling_params(self, req: ChatCompletionRequest) -> SamplingParams:
        """The request's sampling, with the constraint that forces a tool call where tool_choice asks."""
        params = req.to_sampling_params(self.defaults)
        choice = req.tool_choice
        if req.tools and (choice == "required" or isinstance(choice, dict)):
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
            params.structured_outputs = forced_call_constraint(tools, choice, req.parallel_tool_calls,
                                                               params.structured_outputs)
        return params

    def response_role_of(self, req: ChatCompletionRequest) -> str:
        """vLLM's rule: --response-role for a new reply, else the role of the message being continued."""
        return self.response_role if req.add_generation_prompt else req.messages[-1].role

    @staticmethod
    def _chat_logprobs(out: CompletionOutput, top: int) -> ChatLogprobs:
        content = []
        for tid, candidates in zip(out.token_ids, out.logprobs or []):
            sampled = candidates[tid]

            def entry(lp: Any) -> ChatTopLogprob:
                tok = lp.decoded_token or ""
                return ChatTopLogprob(token=tok, logprob=max(lp.logprob, _MIN_LOGPROB), bytes=list(tok.encode("utf-8")))

            ranked = sorted(candidates.values(), key=lambda c: c.rank if c.rank is not None else 0)[:top]
            content.append(ChatTokenLogprob(**entry(sampled).model_dump(), top_logprobs=[entry(c) for c in ranked]))
        return ChatLogprobs(content=content)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Any:
        model = self.model_name(req.model)
        self.parsers(req)  # a bad tool_choice fails before the request is queued
        params = self.sampling_params(req)
        self.check_request(req, params)
        prompt = await self.off_loop(self.chat_prompt, req)
        self.check_context(prompt["prompt_token_ids"], params, "messages")
        request_id = self.request_id("chatcmpl", raw, req)
        ids, streams = self._add(request_id, [prompt], params, req.priority, model)
        if req.stream:
            return StreamingResponse(self._sse_guard(self._chat_stream(req, model, request_id, streams), ids),
                                     media_type="text/event-stream")
        finals = await self._collect(raw, ids, streams)
        if not finals:
            return Response(status_code=499)
        ro = finals[0]
        top = req.top_logprobs or 0
        role = self.response_role_of(req)
        choices = []
        for o in ro.outputs:
            message, finish_reason = self.parsers(req).whole(o.text, role, o.finish_reason)
            choices.append(ChatChoice(index=o.index, message=message, finish_reason=finish_reason,
                                      logprobs=self._chat_logprobs(o, top) if req.logprobs else None,
                                      stop_reason=o.stop_reason))
        usage = self.usage(len(ro.prompt_token_ids), sum(len(o.token_ids) for o in ro.outputs), ro.num_cached_tokens)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _chat_stream(self, req: ChatCompletionRequest, model: str, request_id: str,
                           streams: list[AsyncIterator]) -> AsyncIterator[str]:
        created = int(time.time())
        prompt_tokens = completion_tokens = cached_tokens = 0

        def chunk(choices: list[dict], usage_info: Optional[UsageInfo] = None) -> str:
            return _sse(chat_chunk(request_id, created, model, choices, usage_info))

        role = self.response_role_of(req)
        parsers = [self.parsers(req) for _ in range(req.n)]
        texts = [""] * req.n
        for i in range(req.n):  # the role comes first, once per choice
            yield chunk([chat_stream_choice(i, DeltaMessage(role=role, content=""))])
        async for _, ro in _merge(streams):
            prompt_tokens, cached_tokens = len(ro.prompt_token_ids), ro.num_cached_tokens
            for out in ro.outputs:
                completion_tokens += len(out.token_ids)
                if not out.text and out.finish_reason is None and not out.token_ids:
                    continue
                texts[out.index] += out.text
                choice = parsers[out.index]
                delta = choice.delta(texts[out.index], out.text, final=out.finish_reason is not None)
                finish_reason = choice.finish_reason(out.finish_reason)
                logprobs = self._chat_logprobs(out, req.top_logprobs or 0) if req.logprobs else None
                yield chunk([chat_stream_choice(out.index, delta, logprobs, finish_reason, out.stop_reason)])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], self.usage(prompt_tokens, completion_tokens, cached_tokens))
