"""The `pagedllm` command line: `pagedllm serve [MODEL] [flags]` (vLLM's flag names)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from typing import Any, Callable, Optional, Sequence

from pagedllm.engine.arg_utils import EngineArgs

_ENV_API_KEY = "PAGEDLLM_API_KEY"


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected JSON, got {text!r} ({e})") from None


def _arg_type(annotation: Any) -> tuple[Optional[Callable[[str], Any]], bool]:
    """(the converter for a flag's value, whether it is a bool flag) from a field's type."""
    args = typing.get_args(annotation) if isinstance(annotation, (types.UnionType,)) or \
        typing.get_origin(annotation) is typing.Union else (annotation,)
    args = [a for a in args if a is not type(None)]
    if args == [bool]:
        return None, True
    if len(args) == 1 and args[0] in (int, float, str):
        return args[0], False
    return _json_value, False  # dicts (and callables, given as JSON dicts)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--kebab-case` flag per EngineArgs field, typed from its annotation."""
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine arguments (EngineArgs)")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        convert, is_bool = _arg_type(hints[f.name])
        help_text = f"EngineArgs.{f.name}"
        if is_bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_text)
        else:
            metavar = {int: "INT", float: "FLOAT", str: "STR"}.get(convert, "JSON")
            group.add_argument(flag, dest=f.name, type=convert, default=f.default, metavar=metavar,
                               help=help_text)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference with vLLM's API")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="model folder, GGUF file or hub id; None: the embedded SmolLM2-135M-Instruct")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use for the model; None: MODEL as given")
    serve.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on /v1/* (also env {_ENV_API_KEY})")
    serve.add_argument("--chat-template", default=None, help="chat template file or inline Jinja template")
    serve.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    add_engine_args(serve)
    return parser


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    if ns.model_tag is not None:
        kwargs["model"] = ns.model_tag
    return EngineArgs(**kwargs)


def default_served_name(model: Optional[str]) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model


def serve(ns: argparse.Namespace) -> None:
    import uvicorn

    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app

    engine_args = engine_args_from(ns)
    names = ns.served_model_name or [default_served_name(engine_args.model)]
    api_key = ns.api_key or os.environ.get(_ENV_API_KEY) or None
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        app = build_app(engine, names, api_key=api_key, chat_template=ns.chat_template)
        config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                                timeout_graceful_shutdown=5)
        uvicorn.Server(config).run()  # returns on SIGINT / SIGTERM
    finally:
        engine.shutdown()


def main(argv: Optional[Sequence[str]] = None) -> None:
    ns = make_parser().parse_args(argv)
    if ns.command == "serve":
        try:
            serve(ns)
        except (ValueError, RuntimeError) as e:
            print(f"pagedllm serve: error: {e}", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down cleanly
            sys.exit(130)


if __name__ == "__main__":
    main()
