"""Workload 4: start-up, seconds from process start to the first token of a 1-token request.

The parent notes the wall clock, spawns a fresh Python that imports pagedllm, builds
LLM(shape, load_format="dummy") and generates one token, and stops the clock when the child
reports that token: startup_s is measured by the parent. The child prints time.time() stamps
(same host clock) of its first line, the end of its imports and the phases of LLM() (config
resolution, which imports transformers' config classes; weights; KV sizing with its profiling
forward; the cache's allocation; the kernel warm-up; CUDA graph capture; each timed by wrapping
the function that does it, null where that function did not run), which give the breakdown.
engine_other_s is the rest of LLM(): the second full-size forward that leaves its activation
blocks cached (GPU), the engine's and scheduler's set-up, garbage collection.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from pagedllm.benchmarks.common import SHAPES, emit, parse_engine_args, print_table, write_shape

_MARK = "PAGEDLLM_STARTUP "
# The child's first statement stamps the clock before anything else is imported.
_CHILD_CODE = ("import time; _t0 = time.time()\n"
               "import sys; from pagedllm.benchmarks.startup import child; child(_t0, sys.argv[1])\n")
# phase name -> (module, attribute path) of the function whose duration it is.
_PHASES = {
    "config_s": ("pagedllm.engine.arg_utils", "EngineArgs.create_engine_config"),
    "load_s": ("pagedllm.worker.worker", "load_model"),  # wrapped where the worker looks it up
    "precompile_s": ("pagedllm.worker.worker", "precompile"),
    "kv_sizing_s": ("pagedllm.worker.worker", "Worker.determine_num_blocks"),
    "kv_alloc_s": ("pagedllm.worker.model_runner", "ModelRunner.initialize_kv_cache"),
    "warm_up_s": ("pagedllm.worker.model_runner", "ModelRunner.warm_up_kernels"),
    "cuda_graphs_s": ("pagedllm.worker.cuda_graphs", "CudaGraphs.capture"),
}


def _wrap_phases(spans: dict[str, list[float]]) -> None:
    import functools
    import importlib

    for phase, (module_name, path) in _PHASES.items():
        try:
            owner = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            fn = getattr(owner, name)
        except (ImportError, AttributeError):
            continue  # reported as null

        def timed(*args, _fn=fn, _phase=phase, **kwargs):
            t0 = time.time()
            try:
                return _fn(*args, **kwargs)
            finally:
                spans.setdefault(_phase, []).append(time.time() - t0)

        setattr(owner, name, functools.wraps(fn)(timed))


def child(t0: float, spec_json: str) -> None:
    """Runs in the spawned process: build the engine, generate one token, print the stamps."""
    spec = json.loads(spec_json)
    import torch  # noqa: F401

    from pagedllm import LLM, SamplingParams, TokensPrompt

    t_imported = time.time()
    spans: dict[str, list[float]] = {}
    _wrap_phases(spans)
    llm = LLM(spec["model"], load_format=spec["load_format"], skip_tokenizer_init=True, **spec["engine_kwargs"])
    t_engine = time.time()
    out = llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 17)))],
                       SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False),
                       use_tqdm=False)
    t_token = time.time()
    assert len(out[0].outputs[0].token_ids) == 1
    stamps = {"t_first_line": t0, "t_imported": t_imported, "t_engine": t_engine, "t_token": t_token,
              **{phase: sum(spans[phase]) if phase in spans else None for phase in _PHASES}}
    print(_MARK + json.dumps(stamps), flush=True)


def run_once(model: str, load_format: str, engine_kwargs: dict, timeout_s: float) -> dict:
    """Spawn the child and return the parent-measured start-up plus the child's breakdown."""
    import pagedllm

    src_dir = os.path.dirname(os.path.dirname(os.path.abspath(pagedllm.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src_dir, os.environ.get("PYTHONPATH")]))}
    spec = json.dumps({"model": model, "load_format": load_format, "engine_kwargs": engine_kwargs})
    t_spawn = time.time()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD_CODE, spec], stdout=subprocess.PIPE, env=env, text=True)
    killer = threading.Timer(timeout_s, proc.kill)  # a hung child must not hang the benchmark
    killer.start()
    stamps, t_reported, lines = None, None, []
    try:
        for line in proc.stdout:
            if line.startswith(_MARK):
                t_reported = time.time()
                stamps = json.loads(line[len(_MARK):])
                break
            lines.append(line)
        lines.append(proc.communicate()[0])
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if stamps is None or proc.returncode != 0:
        raise RuntimeError(f"the start-up child exited with {proc.returncode} (killed after {timeout_s} s if "
                           f"negative), token reported: {stamps is not None}; its log is above; stdout tail: "
                           f"{''.join(lines)[-2000:]!r}")
    phases = {k: round(stamps[k], 3) if stamps[k] is not None else None for k in _PHASES}
    engine_s = stamps["t_engine"] - stamps["t_imported"]
    return {
        "startup_s": round(t_reported - t_spawn, 3),
        "interpreter_s": round(stamps["t_first_line"] - t_spawn, 3),
        "import_s": round(stamps["t_imported"] - stamps["t_first_line"], 3),
        "engine_init_s": round(engine_s, 3),
        **phases,
        "engine_other_s": round(engine_s - sum(v for v in phases.values() if v is not None), 3),
        "first_token_s": round(stamps["t_token"] - stamps["t_engine"], 3),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--model", help="a real model folder instead of a dummy shape")
    p.add_argument("--num-runs", type=int, default=1, help="fresh processes, one after the other (the first may "
                                                         "compile kernels that later runs find cached)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--engine-args", default="", help="extra EngineArgs as k=v,k=v")
    args = p.parse_args(argv)

    model = args.model or write_shape(args.shape)
    engine_kwargs = {"dtype": args.dtype, "enforce_eager": args.enforce_eager, "max_model_len": args.max_model_len,
                     **parse_engine_args(args.engine_args)}
    results = []
    for run in range(args.num_runs):
        result = {"benchmark": "startup", "engine": "pagedllm", "shape": args.model or args.shape,
                  "dtype": args.dtype, "enforce_eager": args.enforce_eager, "run": run,
                  **run_once(model, "auto" if args.model else "dummy", engine_kwargs, args.timeout_s)}
        emit(result)
        results.append(result)
    print_table(results, ["run", "startup_s", "interpreter_s", "import_s", "config_s", "load_s", "precompile_s", "kv_sizing_s",
                          "kv_alloc_s", "warm_up_s", "cuda_graphs_s", "engine_other_s", "first_token_s"])


if __name__ == "__main__":
    main()
