"""Cross-encoder inputs, shared by `LLM.score` and the server's /score and /rerank."""
from __future__ import annotations

from typing import Any


def pair_prompts(tokenizer: Any, first: list[str], second: list[str], truncation: bool,
                 max_length: int | None) -> list[dict[str, Any]]:
    """Each (first[i], second[i]) pair as one TokensPrompt, with BERT token types where the
    tokenizer gives them (``truncation`` / ``max_length``: the tokenizer's own pair truncation)."""
    prompts = []
    for a, b in zip(first, second):
        enc = tokenizer(a, b, truncation=truncation, max_length=max_length)
        prompt = {"prompt_token_ids": enc["input_ids"]}
        if enc.get("token_type_ids") is not None:
            prompt["token_type_ids"] = enc["token_type_ids"]
        prompts.append(prompt)
    return prompts
