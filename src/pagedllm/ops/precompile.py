"""Compile a start-up's Triton kernels side by side, in worker processes.

A GPU start-up compiles about a dozen Triton kernel variants (the norms, rotary, the KV
write, the attention launch shapes, the small-row GEMMs, the sampler), one after another in
the engine process, as the profiling forward, the warm-up and graph capture first reach
them: 5-8 s on a fresh machine, where Triton's on-disk cache is empty. Triton's compiler
holds the GIL, so threads do not help; processes do.

So those steps first run *dry* (``collect_compiles``): a Triton hook records the
specialization of each kernel that would compile and skips its launch (outputs of skipped
kernels are left as garbage, which only flows into other skipped kernels and plain GEMMs).
Each kernel missing from Triton's on-disk cache goes, as soon as the dry run finds it, to
processes forked for the purpose (``CompilePool``: they inherit the imported modules, so they
start compiling at once, beside the rest of the dry run; none is made when everything is
cached). Then the steps run for real and load each kernel from the cache. A kernel the dry run
missed just compiles in place, as before. On an H100: 14 kernels in 1.0-1.2 s instead of ~7 s
(compiled after the dry run; since stop 40 they compile during it).

A warm start-up (every kernel already in Triton's cache) skips the dry run too: each start-up
keeps the jobs its dry run found in a small file under pagedllm's cache folder, named by a digest
of what decides them (the engine config without its paths, the GPU, the tensor rank, the
versions of torch and Triton and of every pagedllm module). The next start-up with the same
digest looks those jobs up in Triton's cache and compiles only the missing ones; the dry run's
forwards (1.3-1.5 s on an H100 host for the llama3-8b shape) are not run. A stale or wrong list
costs time only: a kernel it lacks compiles in place, as any the dry run misses. The folder
keeps the newest ``KEPT_JOB_FILES`` files.

Triton's internals used here (the hook and what it is handed, ``ASTSource``, the cache key)
are those the JIT itself compiles with; if they are missing, ``precompile_available`` turns
the whole thing off, and if they fail, ``precompile`` logs it and start-up compiles in place.
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import json
import logging
import os
import pickle
import threading
import time
import warnings
from collections.abc import Callable, Iterator

from pagedllm import envs
from pagedllm.utils import write_cache_file

logger = logging.getLogger("pagedllm")

ENV = "PAGEDLLM_PARALLEL_COMPILE"  # its name (defined in envs): 0 turns the pool off

# The modules whose kernels a start-up compiles; the pool's processes import them up front.
KERNEL_MODULES = ("pagedllm.ops.triton_ops", "pagedllm.ops.triton_gemv", "pagedllm.attention.triton_kernels",
                  "pagedllm.sample.triton_sampler", "pagedllm.ops.triton_fused_moe")


def precompile_available() -> bool:
    if not envs.PAGEDLLM_PARALLEL_COMPILE or os.environ.get("TRITON_INTERPRET") == "1" or not hasattr(os, "fork"):
        return False
    try:
        import triton
        from triton.compiler.compiler import ASTSource, get_cache_key, make_backend  # noqa: F401
        from triton.runtime.cache import get_cache_manager  # noqa: F401
        from triton.runtime.jit import convert_to_tuple_if_list  # noqa: F401

        return hasattr(triton.knobs.runtime, "jit_cache_hook")
    except (ImportError, AttributeError):
        return False


def hash_triton_in_background() -> threading.Thread | None:
    """Start Triton's hash of its own files (``triton_key``, which every kernel's cache key
    needs once per process: 0.45 s on an H100 host, most of it libtriton's ~600 MB) in a
    daemon thread. sha256 releases the GIL, so it runs beside the model's loading instead of
    at the first kernel lookup. Triton is imported here, in the caller's thread. None where
    there is nothing to start (no Triton, or an older one without ``triton_key``)."""
    try:
        from triton.runtime import cache
    except ImportError:
        return None
    triton_key = getattr(cache, "triton_key", None)
    if triton_key is None:
        return None

    def run() -> None:
        try:
            triton_key()  # lru-cached: later callers get the result
        except Exception as e:  # noqa: BLE001 - the first kernel lookup computes (or reports) it
            logger.debug("Hashing Triton in the background failed: %s: %s", type(e).__name__, e)

    thread = threading.Thread(target=run, name="pagedllm-triton-key", daemon=True)
    thread.start()
    return thread


def _source(job):
    """The ``ASTSource`` and options the JIT itself compiles for this job (the hook's own
    objects, so the cache key is the one the engine's later lookup computes); a Gluon kernel's
    source is a ``GluonASTSource``, as its JIT makes it (attention/gluon_prefill.py on Hopper)."""
    from triton.compiler.compiler import ASTSource

    module, name, signature, constants, attrs, options = job
    fn = getattr(importlib.import_module(module), name)
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    return ASTSource(fn, signature, constants, attrs), options


def _in_disk_cache(job, target, backend=None) -> bool:
    """Whether ``triton.compile`` would find this kernel in the on-disk cache (its own lookup)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import get_cache_key, make_backend
    from triton.runtime.cache import get_cache_manager

    src, options = _source(job)
    backend = backend or make_backend(target)
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, parsed, env_vars=get_cache_invalidating_env_vars())
    file_name = f"{src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(file_name) or {}
    return group.get(file_name) is not None


def _compile(job, target, build_launcher: bool = False) -> float:
    """Compile one kernel into Triton's on-disk cache, as the JIT would; returns seconds."""
    import triton

    t0 = time.perf_counter()
    src, options = _source(job)
    kernel = triton.compile(src, target=target, options=options)
    if build_launcher:
        _build_launcher(kernel)
    return time.perf_counter() - t0


def _build_launcher(kernel) -> None:
    """Triton 3.6 (and older) builds each kernel signature's C launcher with the host's C
    compiler at the kernel's first launch, in the engine process: 2.7 s of a fresh H100
    start-up. Built here, into Triton's cache, the engine only loads it. Newer Triton launches
    through one generic launcher, and this builds nothing. A failure costs time only: the
    launcher is built at the first launch, as before. No CUDA call: the binary is not loaded."""
    from triton.runtime.driver import driver

    try:
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception as e:  # noqa: BLE001
        logger.debug("Building a Triton launcher failed: %s: %s", type(e).__name__, e)


def _serve(jobs_fd: int, results_fd: int) -> None:
    """A forked pool process: compile the pickled jobs read from ``jobs_fd`` until it closes,
    answering one pickled (kernel name, seconds, error) each."""
    with os.fdopen(jobs_fd, "rb") as jobs, os.fdopen(results_fd, "wb") as results:
        while True:
            try:
                job, target, build_launcher = pickle.load(jobs)
            except EOFError:
                return
            try:
                reply = (job[1], _compile(job, target, build_launcher), None)
            except Exception as e:  # noqa: BLE001 - reported to the engine, which compiles it in place
                reply = (job[1], 0.0, f"{type(e).__name__}: {e}")
            pickle.dump(reply, results)
            results.flush()


class CompilePool:
    """Forked processes that compile the jobs they are dealt, as they are dealt. Forked, not
    spawned: they start at once with torch, Triton and the kernel modules already imported, and
    they never touch CUDA (Triton compiles for an explicit target), so the parent's CUDA state
    does not matter; nor do they re-run the user's script, as multiprocessing's spawned children
    would. A process is forked for each of the first ``max_workers`` jobs; later jobs are dealt
    round-robin."""

    def __init__(self, max_workers: int, build_launchers: bool = False) -> None:
        for name in KERNEL_MODULES:  # the children inherit them
            importlib.import_module(name)
        import triton.compiler.compiler  # noqa: F401

        self.max_workers = max(1, max_workers)
        self.build_launchers = build_launchers  # on the GPU the jobs are for (see _build_launcher)
        self._procs: list[tuple[int, object, object]] = []
        self._dealt: list[int] = []

    @property
    def num_workers(self) -> int:
        return len(self._procs)

    def _fork(self) -> None:
        jobs_r, jobs_w = os.pipe()
        results_r, results_w = os.pipe()
        with warnings.catch_warnings():
            # Python warns on forking a threaded process: a lock held by another thread stays
            # held in the child. The child takes none of the engine's: it runs Triton's compiler
            # and ptxas only (Python's own import and logging locks are reset on fork), and a
            # stuck one is killed after finish()'s timeout.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: serve, then leave without running the parent's exit hooks
            code = 0
            try:
                os.close(jobs_w)
                os.close(results_r)
                for _, other_jobs_w, other_results_r in self._procs:  # so that each sees its own EOF
                    os.close(other_jobs_w.fileno())
                    os.close(other_results_r.fileno())
                _serve(jobs_r, results_w)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        os.close(jobs_r)
        os.close(results_w)
        self._procs.append((pid, os.fdopen(jobs_w, "wb"), os.fdopen(results_r, "rb")))
        self._dealt.append(0)

    def submit(self, job, target) -> None:
        """Deal one job to a process, which starts compiling it at once."""
        i = sum(self._dealt) % self.max_workers
        if i == len(self._procs):
            self._fork()
        jobs_w = self._procs[i][1]
        pickle.dump((job, target, self.build_launchers), jobs_w)
        jobs_w.flush()
        self._dealt[i] += 1

    def finish(self, timeout_s: float = 180.0) -> list[str]:
        """Wait for every dealt job (at most ``timeout_s``; ``close`` then kills a stuck process,
        and its kernels compile in place later); returns the errors."""
        import select

        for _, jobs_w, _ in self._procs:
            jobs_w.close()  # each process exits after its share
        replies: dict[int, list] = {pid: [] for pid, _, _ in self._procs}
        open_pipes = {results_r.fileno(): (pid, results_r) for pid, _, results_r in self._procs}
        deadline = time.monotonic() + timeout_s
        while open_pipes and time.monotonic() < deadline:
            ready, _, _ = select.select(list(open_pipes), [], [], max(deadline - time.monotonic(), 0))
            for fd in ready:
                pid, results_r = open_pipes[fd]
                try:
                    replies[pid].append(pickle.load(results_r))  # one reply is written whole, flushed
                except EOFError:
                    del open_pipes[fd]
        errors = []
        for (pid, _, _), dealt in zip(self._procs, self._dealt):
            if len(replies[pid]) < dealt:
                errors.append(f"a compile process finished {len(replies[pid])} of {dealt} kernels "
                              f"({'timed out' if open_pipes else 'exited'})")
            errors += [f"{name}: {err}" for name, _, err in replies[pid] if err]
        return errors

    def compile(self, jobs: list, target, timeout_s: float = 180.0) -> list[str]:
        """Compile ``jobs`` and wait for them: ``submit`` each, then ``finish``."""
        for job in jobs:
            self.submit(job, target)
        return self.finish(timeout_s)

    def close(self) -> None:
        import signal

        for pid, jobs_w, results_r in self._procs:
            for f in (jobs_w, results_r):
                if not f.closed:
                    f.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self._procs = []
        self._dealt = []


def pool_size(world_size: int = 1) -> int:
    """Compile processes per engine process: the host's cores shared by ``world_size`` ranks."""
    return max(2, min(16, (os.cpu_count() or 2) // max(world_size, 1) - 1))


LAST_SPECS: set[str] = set()  # the specialization records of the last dry run (for diagnosis)


_DRY_RUN = False


def in_dry_run() -> bool:
    """Whether launches that would compile are being skipped (``collect_compiles``): a kernel
    compiled earlier in this process still runs, and must not read index tensors a skipped one
    left unwritten (callers that allocate such tensors fill them with safe values meanwhile)."""
    return _DRY_RUN


@contextlib.contextmanager
def collect_compiles(on_job: Callable[[tuple], None] | None = None) -> Iterator[list[tuple]]:
    """Within: every Triton launch that would compile is recorded (module, kernel name,
    specialization) and skipped instead; launches of kernels already compiled run. ``on_job``
    is handed each new job as it is found."""
    import triton

    jobs: list[tuple] = []
    seen = LAST_SPECS
    seen.clear()

    def hook(*, fn, compile, **_):
        spec = compile["specialization_data"]
        if spec not in seen:
            seen.add(spec)
            options = json.loads(spec)["options"]  # the parsed options the JIT compiles with
            options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
            jobs.append((fn.module, fn.name, compile["signature"], compile["constants"], compile["configs"][0],
                         options))
            if on_job is not None:
                on_job(jobs[-1])
        return True  # skip the compile, and with it the launch

    global _DRY_RUN
    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = hook
    _DRY_RUN = True
    try:
        yield jobs
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
        _DRY_RUN = False


def _source_digest() -> str:
    """Path, size and modification time of every module and table of the package: an edit can
    change which kernels a start-up compiles."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, subfolders, files in os.walk(root):
        subfolders.sort()
        for name in sorted(f for f in files if f.endswith((".py", ".json"))):
            path = os.path.join(folder, name)
            st = os.stat(path)
            digest.update(f"{os.path.relpath(path, root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return digest.hexdigest()


def jobs_file(key: str) -> str:
    """The file that keeps the jobs of start-ups described by ``key`` (what decides them besides
    the code and the versions, which are added here)."""
    import torch
    import triton

    text = f"{triton.__version__}|{torch.__version__}|{_source_digest()}|{key}"
    return os.path.join(envs.cache_root(), "triton_jobs", hashlib.sha256(text.encode()).hexdigest()[:32] + ".txt")


def load_jobs(path: str) -> list | None:
    """The jobs kept at ``path``: plain literals, read with ``ast.literal_eval`` (nothing runs);
    None when there are none or they do not read back."""
    try:
        with open(path) as f:
            jobs = ast.literal_eval(f.read())
    except (OSError, ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return jobs if isinstance(jobs, list) else None


KEPT_JOB_FILES = 32  # the newest kept: each edit of the package or new config files a new one


def save_jobs(path: str, jobs: list) -> None:
    """Keep ``jobs`` at ``path`` if they are plain literals that read back equal (else nothing is
    kept: the next start-up runs its dry run), and drop all but the ``KEPT_JOB_FILES`` newest
    files of its folder. A read-only cache folder only costs time."""
    text = repr(jobs)
    try:
        if ast.literal_eval(text) != jobs:
            return
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return
    if not write_cache_file(path, text):
        return
    folder = os.path.dirname(path)
    try:
        kept = sorted((os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".txt")),
                      key=os.path.getmtime, reverse=True)
        for old in kept[KEPT_JOB_FILES:]:
            os.remove(old)
    except OSError:  # another start-up may be pruning the same folder
        pass


def precompile(dry_run, device, world_size: int = 1, key: str | None = None) -> None:
    """Run ``dry_run()`` under ``collect_compiles``; each kernel it would have compiled and that
    is not in Triton's cache yet goes to a forked ``CompilePool`` as soon as it is found, so the
    compiles run beside the rest of the dry run. With ``key`` (see ``jobs_file``) the jobs an
    earlier start-up kept stand in for the dry run. Any failure leaves start-up to compile in
    place (logged), never stops it."""
    import torch
    from triton.compiler.compiler import make_backend
    from triton.runtime.driver import driver

    t0 = time.perf_counter()
    pool: CompilePool | None = None
    try:
        path = jobs_file(key) if key is not None else None
        jobs = load_jobs(path) if path is not None else None
        kept = jobs is not None
        target = driver.active.get_current_target()
        backend = make_backend(target)  # its hash runs ptxas once, not once per kernel
        missing: list[tuple] = []

        def compile_if_missing(job: tuple) -> None:
            nonlocal pool
            if not _in_disk_cache(job, target, backend):
                pool = pool or CompilePool(pool_size(world_size), build_launchers=True)
                pool.submit(job, target)
                missing.append(job)

        if kept:
            for job in jobs:
                compile_if_missing(job)
        else:
            with collect_compiles(on_job=compile_if_missing) as jobs:
                dry_run()
            torch.cuda.synchronize(device)
            if path is not None:
                save_jobs(path, jobs)
        t1 = time.perf_counter()
        if pool is not None:
            errors = pool.finish()
            if errors:
                logger.warning("Parallel Triton compile: %s; those compile in place", "; ".join(errors)[:500])
            logger.info("Compiled %d Triton kernels in %d processes in %.1f s (%s, compiling alongside: %.2f s)",
                        len(missing), pool.num_workers, time.perf_counter() - t0,
                        "kept jobs looked up" if kept else "dry run", t1 - t0)
        else:
            logger.debug("Triton kernels all cached (%s %.2f s)", "kept jobs looked up" if kept else "dry run", t1 - t0)
    except Exception as e:  # noqa: BLE001 - an optimisation: start-up compiles in place instead
        logger.warning("Parallel Triton compile failed (%s: %s); compiling in place", type(e).__name__, e)
    finally:
        if pool is not None:
            pool.close()
