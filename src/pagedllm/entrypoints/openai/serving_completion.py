"""/v1/completions: prompts in, completions (whole or streamed) out."""
from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.engine.detokenizer import decode_token
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, completion_chunk,
)
from pagedllm.entrypoints.openai.serving_engine import APIError, OpenAIServing, _MIN_LOGPROB, _merge, _sse
from pagedllm.outputs import Logprob, RequestOutput

logger = logging.getLogger("pagedllm")


class OpenAIServingCompletion(OpenAIServing):
    """The completions handler."""

    def completion_prompts(self, req: CompletionRequest) -> list[dict[str, Any]]:
        """The request's prompts as TokensPrompts (text ones tokenized here, per add_special_tokens)."""
        prompt = req.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(t, int) for t in prompt):
            return [{"prompt_token_ids": prompt}]
        if all(isinstance(p, str) for p in prompt):
            for p in prompt:
                self.check_text_length(p, "prompt")
            encode = self.tokenizer.encode
            return [{"prompt": p, "prompt_token_ids": encode(p, add_special_tokens=req.add_special_tokens)}
                    for p in prompt]
        return [{"prompt_token_ids": p} for p in prompt]

    def _prompt_text(self, ro: RequestOutput) -> str:
        return ro.prompt if ro.prompt is not None else self.tokenizer.decode(ro.prompt_token_ids)

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[Optional[dict[int, Logprob]]],
                             text_offset: int) -> tuple[CompletionLogprobs, int]:
        """The logprobs block of `token_ids` (a None position, the first prompt token, has no
        logprob) and the text offset after the last token."""
        lp = CompletionLogprobs()
        for tid, candidates in zip(token_ids, logprobs):
            if candidates is None:
                token = decode_token(self.tokenizer, tid)
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                token = candidates[tid].decoded_token or ""
                lp.token_logprobs.append(max(candidates[tid].logprob, _MIN_LOGPROB))
                lp.top_logprobs.append({c.decoded_token or "": max(c.logprob, _MIN_LOGPROB)
                                        for c in candidates.values()})
            lp.tokens.append(token)
            lp.text_offset.append(text_offset)
            text_offset += len(token)
        return lp, text_offset

    @staticmethod
    def _echoed_prompt_logprobs(ro: RequestOutput, prompt_logprobs: Optional[list]) -> list:
        return list(prompt_logprobs) if prompt_logprobs is not None else [None] * len(ro.prompt_token_ids)

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Any:
        model = self.model_name(req.model)
        params = req.to_sampling_params(self.defaults)
        self.check_request(req, params)
        prompts = await self.off_loop(self.completion_prompts, req)
        for prompt in prompts:
            self.check_context(prompt["prompt_token_ids"], params, "prompt")
        request_id = self.request_id("cmpl", raw, req)
        ids, streams = self._add(request_id, prompts, params, req.priority, model)
        if req.stream:
            return StreamingResponse(self._sse_guard(self._completion_stream(req, model, request_id, streams), ids),
                                     media_type="text/event-stream")
        finals = await self._collect(raw, ids, streams)
        if len(finals) != len(ids):
            return Response(status_code=499)  # the client left; nobody reads this
        choices = []
        for pi, ro in enumerate(finals):
            for out in ro.outputs:
                prefix = self._prompt_text(ro) if req.echo else ""
                logprobs = None
                if req.logprobs is not None:
                    token_ids, lps = out.token_ids, list(out.logprobs or [])
                    if req.echo:  # the prompt's tokens first, as vLLM and OpenAI report them
                        token_ids = ro.prompt_token_ids + token_ids
                        lps = self._echoed_prompt_logprobs(ro, ro.prompt_logprobs) + lps
                    logprobs, _ = self._completion_logprobs(token_ids, lps, 0)
                choices.append(CompletionChoice(index=pi * req.n + out.index, text=prefix + out.text,
                                                logprobs=logprobs, finish_reason=out.finish_reason,
                                                stop_reason=out.stop_reason))
        usage = self.usage(sum(len(ro.prompt_token_ids) for ro in finals),
                           sum(len(o.token_ids) for ro in finals for o in ro.outputs),
                           sum(ro.num_cached_tokens for ro in finals))
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _completion_stream(self, req: CompletionRequest, model: str, request_id: str,
                                 streams: list[AsyncIterator]) -> AsyncIterator[str]:
        created = int(time.time())
        prompt_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}
        prompt_logprobs: dict[int, list] = {}
        completion_tokens = 0
        echoed: set[int] = set()
        offsets: dict[int, int] = {}  # text offset of each choice's next token
        async for pi, ro in _merge(streams):
            prompt_tokens[pi], cached_tokens[pi] = len(ro.prompt_token_ids), ro.num_cached_tokens
            if ro.prompt_logprobs is not None:  # sent once per prompt, whole
                prompt_logprobs[pi] = ro.prompt_logprobs
            for out in ro.outputs:
                index = pi * req.n + out.index
                completion_tokens += len(out.token_ids)
                if not out.text and out.finish_reason is None and not out.token_ids:
                    continue
                text, token_ids, lps = out.text, out.token_ids, list(out.logprobs or [])
                if req.echo and index not in echoed:
                    echoed.add(index)
                    text = self._prompt_text(ro) + text
                    token_ids = ro.prompt_token_ids + token_ids
                    lps = self._echoed_prompt_logprobs(ro, prompt_logprobs.get(pi)) + lps
                logprobs = None
                if req.logprobs is not None:
                    logprobs, offsets[index] = self._completion_logprobs(token_ids, lps, offsets.get(index, 0))
                yield _sse(completion_chunk(request_id, created, model, index, text, logprobs, out.finish_reason,
                                            out.stop_reason))
        if req.stream_options and req.stream_options.include_usage:
            usage = self.usage(sum(prompt_tokens.values()), completion_tokens, sum(cached_tokens.values()))
            yield _sse(CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage))

    # ---- /v1/chat/completions ----------------------------------------------------------------------
    # ---- /tokenize and /detokenize ------------------------------------------------------------------
