"""``<think>...</think>`` reasoning parsers: DeepSeek-R1 and Qwen3, whole and streamed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from pagedllm.utils import held_back


@dataclass
class ReasoningDelta:
    """One streamed step's new reasoning and content text (None where a side did not grow)."""
    reasoning_content: Optional[str] = None
    content: Optional[str] = None


class ReasoningParser:
    """Splits model text at the think tags. ``split`` returns (reasoning, content) as far as the
    text shows them; both only ever grow by appending (a tag still being written is held
    back), so streaming is the difference between two splits."""

    start_tag, end_tag = "<think>", "</think>"

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        self.start_token_id = vocab.get(self.start_tag)
        self.end_token_id = vocab.get(self.end_tag)
        self._sent = (0, 0)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        raise NotImplementedError

    def _split_thinking(self, text: str, final: bool) -> tuple[str, str]:
        """Text that starts inside the reasoning (the start tag optional): reasoning up to the end tag."""
        body = text.lstrip()
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag):]
        elif not final and self.start_tag.startswith(body):
            return "", ""  # maybe the start tag, still being written
        if self.end_tag in body:
            reasoning, content = body.split(self.end_tag, 1)
            return reasoning, content
        keep = len(body) if final else len(body) - held_back(body, (self.end_tag,))
        return body[:keep], ""

    def extract_reasoning_content(self, model_output: str) -> tuple[Optional[str], Optional[str]]:
        reasoning, content = self.split(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_content_streaming(self, current_text: str, final: bool = False
                                            ) -> Optional[ReasoningDelta]:
        reasoning, content = self.split(current_text, final)
        sent_r, sent_c = self._sent
        delta = ReasoningDelta(reasoning_content=reasoning[sent_r:] or None, content=content[sent_c:] or None)
        self._sent = (max(sent_r, len(reasoning)), max(sent_c, len(content)))
        return delta if delta.reasoning_content or delta.content else None

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """The reasoning is over (so a structured-output constraint applies from here on)."""
        if self.end_token_id is None:
            raise ValueError(f"the tokenizer has no {self.end_tag!r} token: this reasoning parser does not fit it")
        return self.end_token_id in token_ids

    def prompt_ends_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """The prompt itself closed the reasoning (Qwen3 with ``enable_thinking=False`` puts an
        empty ``<think></think>`` block there): the reply is all answer. An end tag counts only
        after the last start tag (an open ``<think>`` in R1's prompt means the reply reasons)."""
        if self.end_token_id is None or self.end_token_id not in prompt_token_ids:
            return False
        last_end = len(prompt_token_ids) - 1 - prompt_token_ids[::-1].index(self.end_token_id)
        starts = [i for i, t in enumerate(prompt_token_ids) if t == self.start_token_id]
        return not starts or starts[-1] < last_end

    def extract_content_ids(self, token_ids: list[int]) -> list[int]:
        """The token ids after the end tag (all of them once the reasoning is over)."""
        if self.end_token_id is None or self.end_token_id not in token_ids:
            return []
        return token_ids[token_ids.index(self.end_token_id) + 1:]


class ReasoningParserManager:
    parsers: dict[str, type[ReasoningParser]] = {}

    @classmethod
    def register_module(cls, *names: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
        def register(parser: type[ReasoningParser]) -> type[ReasoningParser]:
            for name in names:
                cls.parsers[name] = parser
            return parser

        return register

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        if name not in cls.parsers:
            raise ValueError(f"unknown reasoning parser {name!r}; available: {sorted(cls.parsers)}")
        return cls.parsers[name]


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """The reply starts inside the reasoning: R1's template puts ``<think>`` in the prompt (older
    checkpoints write it themselves). Until ``</think>`` everything is reasoning."""

    def split(self, text: str, final: bool) -> tuple[str, str]:
        return self._split_thinking(text, final)


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 writes ``<think>...</think>`` itself when thinking; with ``enable_thinking=False``
    (the template closes an empty think block in the prompt) the reply is all content."""

    def split(self, text: str, final: bool) -> tuple[str, str]:
        body = text.lstrip()
        if body.startswith(self.start_tag) or (not final and body and self.start_tag.startswith(body)):
            return self._split_thinking(text, final)
        if not body and not final:
            return "", ""  # only whitespace so far: the start tag may still come
        if self.end_tag in text:  # a template that opened the block in the prompt
            reasoning, content = text.split(self.end_tag, 1)
            return reasoning, content
        return "", text
