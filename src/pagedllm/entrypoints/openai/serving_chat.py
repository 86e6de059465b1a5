"""/v1/chat/completions: messages through the chat template, replies (whole or streamed) out."""
from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Optional
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, ChatTopLogprob, DeltaMessage, UsageInfo,
)
from pagedllm.outputs import CompletionOutput
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, _MIN_LOGPROB, _merge, _sse

logger = logging.getLogger("pagedllm")


class OpenAIServingChat(OpenAIServing):
    """The chat completions handler."""

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
        params = req.to_sampling_params(self.defaults)
        prompt = self.chat_prompt(req)
        request_id = self.request_id("chatcmpl", raw, req)
        ids, streams = self._add(request_id, [prompt], params, req.priority)
        if req.stream:
            return StreamingResponse(self._sse_guard(self._chat_stream(req, model, request_id, streams), ids),
                                     media_type="text/event-stream")
        finals = await self._collect(raw, ids, streams)
        if not finals:
            return Response(status_code=499)
        ro = finals[0]
        top = req.top_logprobs or 0
        role = self.response_role_of(req)
        choices = [ChatChoice(index=o.index, message=ChatResponseMessage(role=role, content=o.text),
                              logprobs=self._chat_logprobs(o, top) if req.logprobs else None,
                              finish_reason=o.finish_reason, stop_reason=o.stop_reason) for o in ro.outputs]
        usage = self.usage(len(ro.prompt_token_ids), sum(len(o.token_ids) for o in ro.outputs), ro.num_cached_tokens)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _chat_stream(self, req: ChatCompletionRequest, model: str, request_id: str,
                           streams: list[AsyncIterator]) -> AsyncIterator[str]:
        created = int(time.time())
        prompt_tokens = completion_tokens = cached_tokens = 0

        def chunk(choices: list[ChatStreamChoice], usage_info: Optional[UsageInfo] = None) -> str:
            body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                       usage=usage_info).model_dump()
            for choice in body["choices"]:  # a delta carries only what it sets
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return _sse(body)

        role = self.response_role_of(req)
        for i in range(req.n):  # the role comes first, once per choice
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role=role, content=""))])
        async for _, ro in _merge(streams):
            prompt_tokens, cached_tokens = len(ro.prompt_token_ids), ro.num_cached_tokens
            for out in ro.outputs:
                completion_tokens += len(out.token_ids)
                if not out.text and out.finish_reason is None and not out.token_ids:
                    continue
                logprobs = self._chat_logprobs(out, req.top_logprobs or 0) if req.logprobs else None
                yield chunk([ChatStreamChoice(index=out.index, delta=DeltaMessage(content=out.text),
                                              logprobs=logprobs, finish_reason=out.finish_reason,
                                              stop_reason=out.stop_reason)])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], self.usage(prompt_tokens, completion_tokens, cached_tokens))
