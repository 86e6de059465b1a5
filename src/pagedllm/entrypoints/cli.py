"""The `pagedllm` command line (vLLM's flag names): `serve` the OpenAI-compatible API,
`generate` from one prompt in the terminal, `bench` a workload."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import types
import typing
from typing import Any, Callable, Optional, Sequence

from pagedllm import envs
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.cli_args import FrontendArgs, add_frontend_args

# `pagedllm bench NAME` runs pagedllm.benchmarks.<module>.main(argv).
BENCHMARKS = {"throughput": "throughput", "latency": "latency", "startup": "startup", "serve": "serve",
              "cpu": "cpu_vs_hf", "structured": "structured", "spec": "spec_decode", "moe": "moe_kernel",
              "embed": "embed", "quant": "quant_kernel", "long-prompt": "long_prompt", "shared-prefix": "shared_prefix",
              "lora": "lora", "lora-kernel": "lora_kernel", "fp8-kernel": "fp8_kernel",
              "gemv-kernel": "gemv_kernel"}


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


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One `--kebab-case` flag per EngineArgs field, typed from its annotation (`skip`: fields a
    server flag of the same name already sets)."""
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine arguments (EngineArgs)")
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
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


_MODEL_HELP = "model folder, GGUF file or hub id; None: the embedded SmolLM2-135M-Instruct"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference with vLLM's API")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench}")
    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=_MODEL_HELP)
    add_frontend_args(serve)
    add_engine_args(serve, skip=("reasoning_parser",))  # --reasoning-parser: the server's flag feeds both

    gen = sub.add_parser("generate", help="generate from one prompt (or chat message), streaming text to stdout",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompt_arg", nargs="?", default=None, metavar="PROMPT",
                     help="the prompt (or --prompt); neither: read it from stdin")
    gen.add_argument("--prompt", dest="prompt_flag", default=None, metavar="STR", help="the prompt")
    gen.add_argument("--chat", action="store_true",
                     help="send PROMPT as a user message through the chat template")
    gen.add_argument("--system", default=None, metavar="STR", help="a system message first (with --chat)")
    gen.add_argument("--chat-template", default=None, metavar="STR",
                     help="chat template file or inline Jinja template (with --chat); None: the tokenizer's")
    gen.add_argument("--max-tokens", type=int, default=256, metavar="INT", help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=None, metavar="FLOAT",
                     help="0: greedy; None: the model's generation_config default (else 1.0)")
    gen.add_argument("--top-p", type=float, default=None, metavar="FLOAT",
                     help="None: the model's generation_config default (else 1.0)")
    add_engine_args(gen)  # its --seed also seeds this request's sampling
    gen.set_defaults(disable_log_stats=True)  # one request: the stats line would only interleave with the text

    bench = sub.add_parser("bench", help="run a benchmark: pagedllm bench NAME [its flags] (NAME --help lists them)")
    bench.add_argument("benchmark", choices=list(BENCHMARKS), metavar="NAME",
                       help=f"one of {list(BENCHMARKS)} (cpu: pagedllm vs transformers on CPU)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="...", help="the benchmark's own flags")
    return parser


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    if getattr(ns, "model_tag", None) is not None:  # serve's positional MODEL
        kwargs["model"] = ns.model_tag
    return EngineArgs(**kwargs)


def default_served_name(model: Optional[str]) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model


def frontend_args_from(ns: argparse.Namespace) -> FrontendArgs:
    args = FrontendArgs.from_namespace(ns)
    args.api_key = args.api_key or envs.PAGEDLLM_API_KEY or None
    for path in (args.ssl_keyfile, args.ssl_certfile):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"no such TLS file: {path}")
    return args


def uvicorn_kwargs(args: FrontendArgs) -> dict[str, Any]:
    return dict(host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5,
                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)


def serve(ns: argparse.Namespace) -> None:
    from pagedllm.engine.core_client import EngineCoreClient  # no torch: the core process imports it

    args = frontend_args_from(ns)
    engine_args = engine_args_from(ns)
    names = args.served_model_name or [default_served_name(engine_args.model)]
    # The core process starts before this one imports anything heavy (torch alone took 3.5 s on an
    # H100 host), then the config is built and sent, then the app and uvicorn's protocol classes
    # are built while the core builds the model.
    core = EngineCoreClient(None)
    try:
        _skip_triton_without_gpu()
        from pagedllm.engine.async_llm import AsyncLLM
    except BaseException:
        core.shutdown(timeout_s=0.0)
        raise
    engine = AsyncLLM.from_engine_args(engine_args, wait_ready=False, engine_core=core)
    try:
        import uvicorn

        from pagedllm.entrypoints.openai.api_server import build_app

        app = build_app(engine, names, args)
        app.state.uvicorn_server = uvicorn.Server(uvicorn.Config(app, **uvicorn_kwargs(args)))
        app.state.uvicorn_server.config.load()
    except BaseException:
        engine.shutdown(timeout_s=0.0)  # a bad server flag fails now: the core is stopped mid-build
        raise
    try:
        engine.wait_ready()
        app.state.uvicorn_server.run()  # returns on SIGINT / SIGTERM, or when the engine core dies
    finally:
        engine.shutdown()
    if app.state.engine_dead_reason is not None:
        raise RuntimeError(f"the engine core died: {app.state.engine_dead_reason}")  # exit status 1


def _generate_prompt(ns: argparse.Namespace) -> str:
    if ns.prompt_arg is not None and ns.prompt_flag is not None:
        raise ValueError("give the prompt once: as PROMPT or as --prompt")
    prompt = ns.prompt_arg if ns.prompt_arg is not None else ns.prompt_flag
    if prompt is None:
        if sys.stdin.isatty():
            raise ValueError("no prompt: give PROMPT, --prompt, or pipe it on stdin")
        prompt = sys.stdin.read().rstrip("\n")  # `echo PROMPT | pagedllm generate`: not the newline
    if not prompt:
        raise ValueError("the prompt is empty")
    if ns.system is not None and not ns.chat:
        raise ValueError("--system needs --chat")
    return prompt


def generate(ns: argparse.Namespace) -> None:
    """Stream one request's text to stdout as the engine produces it (DELTA outputs)."""
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.chat_utils import apply_chat_template
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    prompt = _generate_prompt(ns)
    overrides = {k: v for k, v in (("temperature", ns.temperature), ("top_p", ns.top_p)) if v is not None}
    # The flags are checked before the model loads: a typo fails in milliseconds, not after the load.
    SamplingParams(**overrides, max_tokens=ns.max_tokens, seed=ns.seed)
    engine = LLMEngine.from_engine_args(engine_args_from(ns))
    params = SamplingParams(**{**engine.model_config.default_sampling_overrides(), **overrides,
                               "max_tokens": ns.max_tokens, "seed": ns.seed, "output_kind": RequestOutputKind.DELTA})
    if ns.chat:
        messages = ([{"role": "system", "content": ns.system}] if ns.system is not None else []) + \
            [{"role": "user", "content": prompt}]
        request: Any = {"prompt_token_ids": apply_chat_template(engine.get_tokenizer(), messages,
                                                                chat_template=ns.chat_template)}
    else:
        request = prompt
    engine.add_request("generate-0", request, params)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        engine.abort_request("generate-0")
        sys.stdout.write("\n")
        raise
    sys.stdout.write("\n")
    sys.stdout.flush()


def bench(ns: argparse.Namespace) -> None:
    """Hand the remaining flags to pagedllm.benchmarks.<module>.main."""
    module_name = f"pagedllm.benchmarks.{BENCHMARKS[ns.benchmark]}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise  # a dependency of the benchmark is missing: say which
        raise ValueError(f"the benchmark module {module_name} is not installed") from None
    module.main(ns.bench_args)


def _skip_triton_without_gpu() -> None:
    """triton's extension prints a long `nanobind: leaked ...` list when a process that loaded it
    exits, which reads like a crash. Without a GPU nothing here runs a Triton kernel (torch and
    transformers import triton only to probe for it, xgrammar only for its GPU kernels), so a
    CPU process of the CLI does not load it."""
    import torch

    if not torch.cuda.is_available() and "triton" not in sys.modules:
        sys.modules["triton"] = None  # `import triton` raises ImportError: "not installed"


def main(argv: Optional[Sequence[str]] = None) -> None:
    ns = make_parser().parse_args(argv)
    if argv is None and ns.command == "generate":  # a process of its own, not a caller's (serve: once its core runs)
        _skip_triton_without_gpu()
    command = {"serve": serve, "generate": generate, "bench": bench}[ns.command]
    try:
        command(ns)
    except (ValueError, RuntimeError) as e:
        print(f"pagedllm {ns.command}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down cleanly
        sys.exit(130)


if __name__ == "__main__":
    main()
