"""Chat messages → prompt token ids through the tokenizer's chat template."""
from __future__ import annotations

import functools
import os
from typing import Any, Union

ChatMessage = dict[str, Any]
_ROLES = ("system", "user", "assistant", "tool", "developer")
# How message content reaches the template (vLLM's --chat-template-content-format): "string"
# joins text parts into one string, "openai" passes a list of {"type": "text", "text"} parts,
# "auto" picks "openai" when the template loops over a message's content.
CONTENT_FORMATS = ("auto", "string", "openai")


def _short(value: Any, limit: int = 80) -> str:
    """A user's value in an error message, cut short (an image_url part may hold megabytes of base64)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...(truncated)"


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


def _is_content_access(node: Any) -> bool:
    import jinja2.nodes as nodes

    while isinstance(node, nodes.Filter):  # `message['content'] | selectattr(...)` still iterates the parts
        node = node.node
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """"openai" when the template loops over a message's content (directly or through a variable
    set from it), else "string" — vLLM's auto-detection, on the template's Jinja syntax tree."""
    import jinja2
    import jinja2.nodes as nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    content_vars = {a.target.name for a in tree.find_all(nodes.Assign)
                    if isinstance(a.target, nodes.Name) and _is_content_access(a.node)}
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter):
            it = it.node
        if _is_content_access(it) or (isinstance(it, nodes.Name) and it.name in content_vars):
            return "openai"
    return "string"


def resolve_content_format(content_format: str, template: str | None) -> str:
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {list(CONTENT_FORMATS)}, got {content_format!r}")
    if content_format != "auto":
        return content_format
    return detect_content_format(template) if isinstance(template, str) else "string"


def _text_parts(content: Union[str, list, None], i: int) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}} (this server "
                                 f"takes text only), got {_short(part)}")
            parts.append(part["text"])
        return parts
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


def normalize_messages(messages: list[ChatMessage], content_format: str = "string") -> list[ChatMessage]:
    """Check roles and give every message's content the template's format: one string
    (text parts joined by newlines) or a list of text parts."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with a 'role'")
        if m["role"] not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(_ROLES)}, got {m['role']!r}")
        parts = _text_parts(m.get("content"), i)
        content: Any = [{"type": "text", "text": t} for t in parts] if content_format == "openai" else "\n".join(parts)
        out.append({**m, "content": content})
    return out


def render_chat_template(
    tokenizer: Any, messages: list[ChatMessage], *, chat_template: str | None = None,
    add_generation_prompt: bool = True, continue_final_message: bool = False, content_format: str = "auto",
    **kwargs: Any,
) -> str:
    """The prompt text the chat template makes of `messages`."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    template = load_chat_template(chat_template)
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; pass chat_template=")
    content_format = resolve_content_format(content_format, template or tokenizer.chat_template)
    return tokenizer.apply_chat_template(
        normalize_messages(messages, content_format), chat_template=template, tokenize=False,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **kwargs,
    )


def apply_chat_template(tokenizer: Any, messages: list[ChatMessage], **kwargs: Any) -> list[int]:
    """The prompt token ids of `messages` (render_chat_template's arguments)."""
    # The template writes any BOS itself: tokenizing must not add another.
    return tokenizer.encode(render_chat_template(tokenizer, messages, **kwargs), add_special_tokens=False)
