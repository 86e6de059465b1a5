"""Compile a start-up's Triton kernels side by side, in worker processes.

A GPU start-up compiles about a dozen Triton kernel variants (the norms, rotary, the KV
write, the attention launch shapes, the small-row GEMMs, the sampler), one after another in
the engine process, as the profiling forward, the warm-up and graph capture first reach
them: 5-8 s on a fresh machine, where Triton's on-disk cache is empty. Triton's compiler
holds the GIL, so threads do not help; processes do.

So those steps first run *dry* (``collect_compiles``): a Triton hook records the
specialization of each kernel that would compile and skips its launch (outputs of skipped
kernels are left as garbage, which only flows into other skipped kernels and plain GEMMs).
The kernels missing from Triton's on-disk cache are then compiled at once by a pool of
processes (``CompilePool``, started when the worker starts, so that its processes import
torch and Triton while the engine loads the model). Then the steps run for real and load
each kernel from the cache. A kernel the dry run missed just compiles in place, as before.

Triton's internals used here (the hook, the specialization record, the cache key) are
those of ``JITFunction.preload``; if they change, ``precompile_available`` turns the whole
thing off and start-up compiles in place.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import time
from collections.abc import Iterator

logger = logging.getLogger("pagedllm")

ENV = "PAGEDLLM_PARALLEL_COMPILE"  # 0 turns it off
# The modules whose kernels a start-up compiles; the pool's processes import them up front.
KERNEL_MODULES = ("pagedllm.ops.triton_ops", "pagedllm.ops.triton_gemv", "pagedllm.attention.triton_kernels",
                  "pagedllm.sample.triton_sampler")


def precompile_available() -> bool:
    if os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        import triton
        from triton.compiler.compiler import ASTSource, get_cache_key, make_backend  # noqa: F401
        from triton.runtime.cache import get_cache_manager  # noqa: F401
        from triton.runtime.jit import convert_to_tuple_if_list  # noqa: F401

        return hasattr(triton.knobs.runtime, "jit_cache_hook")
    except (ImportError, AttributeError):
        return False


def _parse(spec_json: str):
    """What ``JITFunction.preload`` reads from a specialization record."""
    import triton.language as tl
    from triton.runtime.jit import convert_to_tuple_if_list

    d = json.loads(spec_json)
    constexprs = {
        tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
        tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
        for k, v in zip(d["constant_keys"], d["constant_vals"])
    }
    attrs = dict(zip(map(tuple, d["attrs_keys"]), d["attrs_vals"]))
    signature = {k: convert_to_tuple_if_list(v) for k, v in d["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items()}
    return signature, constexprs, attrs, options


def _source(module: str, name: str, spec_json: str):
    from triton.compiler.compiler import ASTSource

    fn = getattr(importlib.import_module(module), name)
    signature, constexprs, attrs, options = _parse(spec_json)
    return ASTSource(fn, signature, constexprs, attrs), options


def _in_disk_cache(module: str, name: str, spec_json: str, target) -> bool:
    """Whether ``triton.compile`` would find this kernel in the on-disk cache (its own lookup)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import get_cache_key, make_backend
    from triton.runtime.cache import get_cache_manager

    src, options = _source(module, name, spec_json)
    backend = make_backend(target)
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, parsed, env_vars=get_cache_invalidating_env_vars())
    file_name = f"{src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(file_name) or {}
    return group.get(file_name) is not None


def _compile(module: str, name: str, spec_json: str, target) -> float:
    """In a pool process: compile one kernel into Triton's on-disk cache; returns seconds."""
    import triton
    from triton.compiler.compiler import make_backend

    t0 = time.perf_counter()
    src, options = _source(module, name, spec_json)
    parsed = make_backend(target).parse_options(options)
    triton.compile(src, target=target, options=parsed.__dict__)
    return time.perf_counter() - t0


def serve() -> None:
    """A pool process (``python -c "...; serve()"``): import the kernel modules at once, then
    compile the jobs read from stdin, one JSON line each, answering one line per job."""
    import sys

    from triton.backends.compiler import GPUTarget

    for name in KERNEL_MODULES:
        importlib.import_module(name)
    for line in sys.stdin:
        module, name, spec, target = json.loads(line)
        try:
            seconds = _compile(module, name, spec, GPUTarget(*target))
            print(json.dumps([name, seconds, None]), flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the engine, which compiles it in place
            print(json.dumps([name, 0.0, f"{type(e).__name__}: {e}"]), flush=True)


class CompilePool:
    """Processes that import the kernel modules as soon as they start, then compile what they
    are given. Plain subprocesses running ``serve`` (not multiprocessing, whose spawned
    children would re-run an unguarded user script). Start it early; ``close`` it after."""

    def __init__(self, num_workers: int) -> None:
        import subprocess
        import sys

        self.num_workers = num_workers
        self._procs = [
            subprocess.Popen([sys.executable, "-c", "from pagedllm.ops.precompile import serve; serve()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for _ in range(num_workers)
        ]

    def compile(self, jobs: list[tuple[str, str, str]], target) -> list[str]:
        """Compile ``jobs`` (dealt round-robin), wait for all; returns the errors, if any."""
        target_args = [target.backend, target.arch, target.warp_size]
        shares = [jobs[i::self.num_workers] for i in range(self.num_workers)]
        errors = []
        for proc, share in zip(self._procs, shares):
            for job in share:
                proc.stdin.write(json.dumps([*job, target_args]) + "\n")
            proc.stdin.close()  # the process exits after its share
        for proc, share in zip(self._procs, shares):
            replies = [json.loads(line) for line in proc.stdout]
            proc.wait()
            if len(replies) < len(share):
                errors.append(f"a compile process exited with {proc.returncode} after {len(replies)} of "
                              f"{len(share)} kernels")
            errors += [f"{name}: {err}" for name, _, err in replies if err]
        return errors

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None and not f.closed:
                    f.close()


def start_compile_pool(world_size: int = 1) -> CompilePool | None:
    """A pool sized to the host's cores (shared by ``world_size`` engine processes), or None
    where precompiling is off or unavailable."""
    if not precompile_available():
        return None
    workers = max(2, min(12, (os.cpu_count() or 2) // max(world_size, 1) - 1))
    try:
        return CompilePool(workers)
    except OSError as e:  # no processes here: compile in place
        logger.debug("No compile pool (%s)", e)
        return None


@contextlib.contextmanager
def collect_compiles() -> Iterator[list[tuple[str, str, str]]]:
    """Within: every Triton launch that would compile is recorded (module, kernel name,
    specialization) and skipped instead; launches of kernels already compiled run."""
    import triton

    jobs: list[tuple[str, str, str]] = []
    seen: set[str] = set()

    def hook(*, fn, compile, **_):
        spec = compile["specialization_data"]
        if spec not in seen:
            seen.add(spec)
            jobs.append((fn.module, fn.name, spec))
        return True  # skip the compile, and with it the launch

    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield jobs
    finally:
        triton.knobs.runtime.jit_cache_hook = previous


def precompile(pool: CompilePool, dry_run, device) -> None:
    """Run ``dry_run()`` under ``collect_compiles``, then compile what it would have compiled
    and is not in Triton's cache yet, in ``pool``. Any failure leaves start-up to compile in
    place (logged), never stops it."""
    from triton.runtime.driver import driver

    t0 = time.perf_counter()
    try:
        with collect_compiles() as jobs:
            dry_run()
        target = driver.active.get_current_target()
        missing = [job for job in jobs if not _in_disk_cache(*job, target)]
        if missing:
            errors = pool.compile(missing, target)
            if errors:
                logger.warning("Parallel Triton compile: %s; those compile in place", "; ".join(errors)[:500])
            logger.info("Compiled %d Triton kernels in %d processes in %.1f s", len(missing), pool.num_workers,
                        time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - an optimisation: start-up compiles in place instead
        logger.warning("Parallel Triton compile failed (%s: %s); compiling in place", type(e).__name__, e)
    finally:
        import torch

        if device.type == "cuda":
            torch.cuda.synchronize(device)
