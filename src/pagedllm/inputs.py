"""Prompt types accepted by `LLM.generate` and `LLMEngine.add_request` (vLLM's shapes)."""
from __future__ import annotations

from typing import TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt, list[int]]
