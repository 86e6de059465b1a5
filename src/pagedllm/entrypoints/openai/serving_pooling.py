"""The pooling endpoints over one AsyncLLM serving a pooling model: /v1/embeddings, /pooling,
/classify, /score and /rerank. Inputs are tokenized off the event loop; every request of a
call is submitted before any is awaited, so the engine batches them; a client that goes away
aborts them all."""
from __future__ import annotations

import base64
from typing import Any, Optional

import numpy as np
from fastapi import Request

from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.entrypoints.score_utils import pair_prompts
from pagedllm.entrypoints.openai.protocol import BadParam
from pagedllm.entrypoints.openai.protocol_pooling import (
    ClassificationData, ClassificationRequest, ClassificationResponse, EmbeddingData, EmbeddingRequest,
    EmbeddingResponse, PoolingData, PoolingRequest, PoolingResponse, RerankDocument, RerankRequest, RerankResponse,
    RerankResult, ScoreData, ScoreRequest, ScoreResponse, UsageInfo,
)
from pagedllm.entrypoints.openai.serving_engine import APIError, OpenAIServing
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams


class OpenAIServingPooling(OpenAIServing):
    def _check_pooling_model(self) -> None:
        if self.engine.model_config.runner_type != "pooling":
            raise APIError(400, f"The model `{self.served_model_names[0]}` generates text: this endpoint needs a "
                                "pooling model (serve it with --runner pooling)")

    # ---- inputs -------------------------------------------------------------------------------
    def _prompts(self, inputs: Any, add_special_tokens: bool, param: str = "input") -> list[dict[str, Any]]:
        """A text, texts, token ids or lists of token ids as TokensPrompts."""
        if isinstance(inputs, str):
            inputs = [inputs]
        if not inputs:
            raise BadParam(param, f"{param} must not be empty")
        if all(isinstance(t, int) for t in inputs):
            inputs = [inputs]
        prompts: list = []
        texts = []  # (index, text): tokenized together below, in one batch call
        for item in inputs:
            if isinstance(item, str):
                if not item:
                    raise BadParam(param, f"{param} must not hold an empty string")
                self.check_text_length(item, param)
                texts.append((len(prompts), item))
                prompts.append(None)
            elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
                prompts.append({"prompt_token_ids": item})
            else:
                raise BadParam(param, f"{param} must be a string, a list of strings, token ids or lists of token "
                                      "ids, none empty")
        if texts:
            ids = self.tokenizer([t for _, t in texts], add_special_tokens=add_special_tokens)["input_ids"]
            for (i, text), token_ids in zip(texts, ids):
                prompts[i] = {"prompt": text, "prompt_token_ids": token_ids}
        return prompts

    def _chat_prompt(self, req: EmbeddingRequest) -> list[dict[str, Any]]:
        kwargs = dict(req.chat_template_kwargs or {})
        ids = apply_chat_template(self.tokenizer, req.messages, chat_template=req.chat_template or self.chat_template,
                                  add_generation_prompt=req.add_generation_prompt,
                                  continue_final_message=req.continue_final_message,
                                  content_format=self.content_format, **kwargs)
        return [{"prompt_token_ids": ids}]

    def _pair_prompts(self, first: list[str], second: list[str], truncate: Optional[int]) -> list[dict[str, Any]]:
        """Cross-encoder inputs: each pair as one sequence, with BERT token types where the
        tokenizer gives them."""
        for a, b in zip(first, second):
            self.check_text_length(a + b, "text")
        cut = truncate not in (None, -1)
        return pair_prompts(self.tokenizer, first, second, truncation=cut, max_length=truncate if cut else None)

    # ---- running --------------------------------------------------------------------------------
    async def _run(self, raw: Request, prefix: str, req: Any, prompts: list[dict[str, Any]],
                   params: PoolingParams) -> list[PoolingRequestOutput]:
        self._check_pooling_model()
        request_id = self.request_id(prefix, raw, req)
        ids, streams = self._add(request_id, prompts, params, req.priority)
        return await self._collect(raw, ids, streams)

    def _params(self, req: Any, task: str, **extra: Any) -> PoolingParams:
        try:
            return PoolingParams(task=task, truncate_prompt_tokens=req.truncate_prompt_tokens,
                                 use_activation=getattr(req, "use_activation", None),
                                 normalize=getattr(req, "normalize", None), **extra)
        except ValueError as e:
            raise BadParam("dimensions" if "dimensions" in str(e) else "input", str(e)) from None

    def _usage(self, outputs: list[PoolingRequestOutput]) -> UsageInfo:
        n = sum(len(o.prompt_token_ids) for o in outputs)
        return UsageInfo(prompt_tokens=n, total_tokens=n)

    @staticmethod
    def _encode(data: Any, encoding_format: str) -> Any:
        array = data.numpy().astype(np.float32)
        if encoding_format == "base64":
            return base64.b64encode(array.tobytes()).decode()
        return array.tolist()

    # ---- endpoints ------------------------------------------------------------------------------
    async def create_embedding(self, req: EmbeddingRequest, raw: Request) -> Any:
        model = self.model_name(req.model)
        if (req.input is None) == (req.messages is None):
            raise BadParam("input", "give input or messages (one of them)")
        prompts = await self.off_loop(self._chat_prompt, req) if req.messages is not None else \
            await self.off_loop(self._prompts, req.input, req.add_special_tokens)
        outputs = await self._run(raw, "embd", req, prompts, self._params(req, "embed", dimensions=req.dimensions))
        if not outputs:
            return None  # the client went away
        data = [EmbeddingData(index=i, embedding=self._encode(o.outputs.data, req.encoding_format))
                for i, o in enumerate(outputs)]
        return EmbeddingResponse(model=model, data=data, usage=self._usage(outputs))

    async def create_pooling(self, req: PoolingRequest, raw: Request) -> Any:
        model = self.model_name(req.model)
        if (req.input is None) == (req.messages is None):
            raise BadParam("input", "give input or messages (one of them)")
        prompts = await self.off_loop(self._chat_prompt, req) if req.messages is not None else \
            await self.off_loop(self._prompts, req.input, req.add_special_tokens)
        params = self._params(req, req.task or "encode", dimensions=req.dimensions)
        outputs = await self._run(raw, "pool", req, prompts, params)
        if not outputs:
            return None
        data = [PoolingData(index=i, data=self._encode(o.outputs.data, req.encoding_format))
                for i, o in enumerate(outputs)]
        return PoolingResponse(model=model, data=data, usage=self._usage(outputs))

    async def create_classify(self, req: ClassificationRequest, raw: Request) -> Any:
        model = self.model_name(req.model)
        prompts = await self.off_loop(self._prompts, req.input, req.add_special_tokens)
        outputs = await self._run(raw, "classify", req, prompts, self._params(req, "classify"))
        if not outputs:
            return None
        labels = getattr(self.engine.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outputs):
            probs = o.outputs.data.tolist()
            best = int(np.argmax(probs))
            data.append(ClassificationData(index=i, label=labels.get(best, labels.get(str(best))), probs=probs,
                                           num_classes=len(probs)))
        return ClassificationResponse(model=model, data=data, usage=self._usage(outputs))

    async def _scores(self, raw: Request, prefix: str, req: Any, first: list[str], second: list[str]
                      ) -> tuple[list[float], list[PoolingRequestOutput]]:
        """Scores of the (first[i], second[i]) pairs: a cross-encoder's, or the cosine of two
        embeddings."""
        if self.engine.model_config.pooling_kind == "embed":
            texts = list(dict.fromkeys(first + second))
            prompts = await self.off_loop(self._prompts, texts, req.add_special_tokens, "text")
            params = self._params(req, "embed")
            params.use_activation = True
            outputs = await self._run(raw, prefix, req, prompts, params)
            if not outputs:
                return [], []
            vec = {t: o.outputs.data for t, o in zip(texts, outputs)}
            return [float((vec[a] * vec[b]).sum()) for a, b in zip(first, second)], outputs
        prompts = await self.off_loop(self._pair_prompts, first, second, req.truncate_prompt_tokens)
        outputs = await self._run(raw, prefix, req, prompts, self._params(req, "score"))
        if outputs and outputs[0].outputs.data.numel() != 1:
            raise APIError(400, "score needs a model with one output label (a cross-encoder) or an embedding model")
        return [float(o.outputs.data.reshape(-1)[0]) for o in outputs], outputs

    async def create_score(self, req: ScoreRequest, raw: Request) -> Any:
        model = self.model_name(req.model)
        first = next((x for x in (req.text_1, req.queries, req.data_1) if x is not None), None)
        second = next((x for x in (req.text_2, req.documents, req.data_2) if x is not None), None)
        if first is None or second is None:
            raise BadParam("text_1", "give text_1 and text_2 (or queries and documents)")
        first = [first] if isinstance(first, str) else list(first)
        second = [second] if isinstance(second, str) else list(second)
        if not first or not second or not all(first + second):
            raise BadParam("text_1", "text_1 and text_2 must be non-empty texts")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise BadParam("text_2", f"score pairs 1:1, 1:N or N:N; got {len(first)} and {len(second)} texts")
        scores, outputs = await self._scores(raw, "score", req, first, second)
        if not outputs:
            return None
        return ScoreResponse(model=model, data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=self._usage(outputs))

    async def create_rerank(self, req: RerankRequest, raw: Request) -> Any:
        model = self.model_name(req.model)
        if not req.query:
            raise BadParam("query", "query must not be empty")
        if not req.documents or not all(req.documents):
            raise BadParam("documents", "documents must be a non-empty list of non-empty texts")
        scores, outputs = await self._scores(raw, "rerank", req, [req.query] * len(req.documents), req.documents)
        if not outputs:
            return None
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[:req.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in order]
        return RerankResponse(model=model, usage=self._usage(outputs), results=results)
