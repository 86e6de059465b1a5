"""Reasoning parsers by name (``--reasoning-parser NAME``): ``<think>...</think>`` → the message's
``reasoning_content``, the rest → ``content``.

How the server uses them (one parser instance per request and choice): whole response,
``reasoning, content = parser.extract_reasoning_content(text)``; streaming, after each output
``delta = parser.extract_reasoning_content_streaming(text_so_far)`` (and once with
``final=True``), whose ``reasoning_content`` / ``content`` go into the chunk's delta; a
structured-output constraint starts applying once the reasoning is over: the structured-output
manager (``structured_outputs_config.reasoning_parser``) leaves a request's tokens unmasked until
it samples the end tag (or its prompt closed the reasoning: ``prompt_ends_reasoning``).
This room sits beside the scheduler so that both the server and the engine read it.
"""
from pagedllm.reasoning.parsers import (
    DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningDelta, ReasoningParser, ReasoningParserManager,
)

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningDelta", "ReasoningParser",
           "ReasoningParserManager"]
