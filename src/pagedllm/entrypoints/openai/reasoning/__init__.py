"""Reasoning parsers by name (``--reasoning-parser NAME``): ``<think>...</think>`` → the message's
``reasoning_content``, the rest → ``content``.

How the server uses them (one parser instance per request and choice): whole response,
``reasoning, content = parser.extract_reasoning_content(text)``; streaming, after each output
``delta = parser.extract_reasoning_content_streaming(text_so_far)`` (and once with
``final=True``), whose ``reasoning_content`` / ``content`` go into the chunk's delta; a
structured-output constraint starts applying once ``parser.is_reasoning_end(token_ids)``.
"""
from pagedllm.entrypoints.openai.reasoning.parsers import (
    DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningDelta, ReasoningParser, ReasoningParserManager,
)

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningDelta", "ReasoningParser",
           "ReasoningParserManager"]
