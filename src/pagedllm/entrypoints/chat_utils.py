"""Chat messages → prompt token ids through the tokenizer's chat template."""
from __future__ import annotations

import os
from typing import Any, Union

ChatMessage = dict[str, Any]
_ROLES = ("system", "user", "assistant", "tool", "developer")


def load_chat_template(chat_template: str | None) -> str | None:
    """A chat template given inline or as a path to a file (vLLM's --chat-template)."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template) as f:
            return f.read()
    if any(c in chat_template for c in "{}\n"):
        return chat_template
    raise ValueError(f"chat_template {chat_template!r} is neither a file nor a Jinja template")


def _content_to_text(content: Union[str, list, None], i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}, got {part!r}")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


def normalize_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Check roles and flatten list-of-parts content into strings, for string-format templates."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with a 'role'")
        if m["role"] not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(_ROLES)}, got {m['role']!r}")
        out.append({**m, "content": _content_to_text(m.get("content"), i)})
    return out


def apply_chat_template(
    tokenizer: Any, messages: list[ChatMessage], *, chat_template: str | None = None,
    add_generation_prompt: bool = True, continue_final_message: bool = False, **kwargs: Any,
) -> list[int]:
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    template = load_chat_template(chat_template)
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; pass chat_template=")
    text = tokenizer.apply_chat_template(
        normalize_messages(messages), chat_template=template, tokenize=False,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **kwargs,
    )
    # The template writes any BOS itself: tokenizing must not add another.
    return tokenizer.encode(text, add_special_tokens=False)
