"""FrontendArgs: the server's own flags (vLLM's names, defaults and meanings), one `--flag` per field."""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.entrypoints.chat_utils import CONTENT_FORMATS

ENV_API_KEY = "PAGEDLLM_API_KEY"
_UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def json_str_list(text: str) -> list[str]:
    """A flag value that is a JSON list of strings, e.g. '["https://a.example", "https://b.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r} ({e})") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _opt(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    factory = (lambda: list(default)) if isinstance(default, list) else None
    meta = {"help": help, "argparse": argparse_kwargs}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass
class FrontendArgs:
    host: str = _opt("0.0.0.0", "address to listen on")
    port: int = _opt(8000, "port to listen on", type=int)
    uvicorn_log_level: str = _opt("info", "uvicorn's log level", choices=_UVICORN_LOG_LEVELS)
    api_key: Optional[str] = _opt(None, f"require 'Authorization: Bearer KEY' on /v1/* (also env {ENV_API_KEY})")
    served_model_name: Optional[list[str]] = _opt(
        None, "name(s) clients use for the model (the first one in responses); None: MODEL as given", nargs="+")
    chat_template: Optional[str] = _opt(None, "chat template file or inline Jinja template; None: the tokenizer's")
    chat_template_content_format: str = _opt(
        "auto", "how message content reaches the template: 'string' (text parts joined into one string), "
        "'openai' (a list of {'type': 'text', 'text'} parts), 'auto' (openai when the template loops over a "
        "message's content, else string)", choices=CONTENT_FORMATS)
    response_role: str = _opt("assistant", "the role of the reply in chat responses when add_generation_prompt is "
                                           "true (otherwise the last message's role)")
    allowed_origins: list[str] = _opt(["*"], "CORS allowed origins (JSON list)", type=json_str_list)
    allowed_methods: list[str] = _opt(["*"], "CORS allowed methods (JSON list)", type=json_str_list)
    allowed_headers: list[str] = _opt(["*"], "CORS allowed headers (JSON list)", type=json_str_list)
    allow_credentials: bool = _opt(False, "CORS: allow credentials", action="store_true")
    root_path: Optional[str] = _opt(None, "FastAPI root_path, when a path-based proxy serves the app under a prefix")
    enable_request_id_headers: bool = _opt(
        False, "send an X-Request-Id response header: the client's X-Request-Id, or a generated one "
        "(a client's X-Request-Id always names the engine request)", action="store_true")
    disable_log_requests: bool = _opt(False, "do not log one line per request", action="store_true")
    max_log_len: Optional[int] = _opt(None, "characters of prompt and prompt token ids in the request log line; "
                                            "None: all", type=int)
    ssl_keyfile: Optional[str] = _opt(None, "TLS private key file (serve HTTPS; needs --ssl-certfile)")
    ssl_certfile: Optional[str] = _opt(None, "TLS certificate file (serve HTTPS; needs --ssl-keyfile)")
    disable_fastapi_docs: bool = _opt(False, "no /docs, /redoc or /openapi.json", action="store_true")
    enable_prompt_tokens_details: bool = _opt(
        False, "report usage.prompt_tokens_details.cached_tokens (prompt tokens served from the prefix cache)",
        action="store_true")

    max_request_body_bytes: int = _opt(
        4 * 1024 * 1024, "request bodies larger than this get a 413 (the limit bounds what one client makes the "
        "server read, parse and tokenize)", type=int)
    keep_serving_without_engine: bool = _opt(
        False, "when the engine core dies, keep answering 503 instead of exiting (vLLM exits, so that a supervisor "
        "restarts the server)", action="store_true")
    enable_auto_tool_choice: bool = _opt(
        False, "let the model decide to call tools (tool_choice 'auto'); needs --tool-call-parser", action="store_true")
    tool_call_parser: Optional[str] = _opt(
        None, "how the model writes tool calls: hermes, llama3_json, mistral, pythonic, qwen3_xml, qwen3_coder, "
        "or a name registered by --tool-parser-plugin")
    tool_parser_plugin: Optional[str] = _opt(None, "a Python file that registers more tool call parsers")
    lora_modules: Optional[list[str]] = _opt(
        None, "LoRA adapters to serve, each name=path or JSON {\"name\", \"path\", \"base_model_name\"}; a "
        "request's model picks one (needs --enable-lora)", nargs="+")
    reasoning_parser: Optional[str] = _opt(
        None, "split <think> reasoning into the message's reasoning_content: deepseek_r1 or qwen3; a "
        "structured-output constraint (tool_choice required/named too) then applies to the answer after it")

    def __post_init__(self) -> None:
        self._check_parsers()
        if self.lora_modules:
            from pagedllm.entrypoints.openai.serving_models import parse_lora_module

            for text in self.lora_modules:
                parse_lora_module(text)
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0 or None, got {self.max_log_len}")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {list(CONTENT_FORMATS)}, "
                             f"got {self.chat_template_content_format!r}")

    def _check_parsers(self) -> None:
        """Parser flags fail at start-up, before the model loads (the plugin file runs here)."""
        from pagedllm.reasoning import ReasoningParserManager
        from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager, import_tool_parser_plugin

        if self.tool_parser_plugin is not None:
            import_tool_parser_plugin(self.tool_parser_plugin)
        if self.tool_call_parser is not None:
            ToolParserManager.get_tool_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.reasoning_parser is not None:
            ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "FrontendArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server arguments")
    for f in dataclasses.fields(FrontendArgs):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kwargs = dict(f.metadata["argparse"])
        if kwargs.get("action") is None and "metavar" not in kwargs and "choices" not in kwargs:
            kwargs["metavar"] = {int: "INT", json_str_list: "JSON"}.get(kwargs.get("type"), "STR")
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=default, help=f.metadata["help"],
                           **kwargs)
