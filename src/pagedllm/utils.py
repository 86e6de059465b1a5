"""Small process-wide helpers."""
from __future__ import annotations

import contextlib
import gc
import os

from pagedllm import envs


def freeze_gc_heap() -> None:
    """Collect once, then move every object alive now into the collector's permanent
    generation. Start-up leaves millions of long-lived objects (torch, transformers, the
    model's modules, the tokenizer); a full collection walks all of them, which stalled an
    engine step for 120-140 ms twice per offline throughput run on an H100. Frozen, they are
    no longer scanned, so collections only walk what serving allocates. vLLM does the same
    after start-up. Call it at the end of a process's initialisation."""
    gc.collect()
    gc.freeze()


# While an engine runs, a full collection (CPython's generation 2) happens after this many collections of
# generation 1 (CPython's default: 10), still only once the survivors have grown by a quarter.
FULL_GC_AFTER = 1000


def rare_full_collections() -> None:
    """Make full collections rare in a process that runs the engine. Each one walks every live
    request's token lists (prompt and output ids: the frontend's, the scheduler's and the worker's
    copies): 17 ms for 1,000 workload-1 requests on a 2-core VM, 46-73 ms on an H200 host under the
    profiler, each a GPU idle gap as long (5 of them in a 5.9 s qwen3-0.6b run). Young collections
    go on as before; cyclic garbage that grew old waits longer."""
    t0, t1, t2 = gc.get_threshold()
    gc.set_threshold(t0, t1, max(t2, FULL_GC_AFTER))


@contextlib.contextmanager
def fewer_full_collections():
    """``rare_full_collections`` for a block of the caller's process (``LLM.generate``), then the
    thresholds as they were."""
    thresholds = gc.get_threshold()
    rare_full_collections()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could be the start of one of ``markers``."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                best = max(best, n)
                break
    return best


def check_profiling_on() -> None:
    """Raises unless PAGEDLLM_TORCH_PROFILER_DIR is set. LLM / AsyncLLM check it in their own
    process before asking the workers (a worker that raises stops the engine)."""
    if not envs.PAGEDLLM_TORCH_PROFILER_DIR:
        raise RuntimeError("profiling is off: set PAGEDLLM_TORCH_PROFILER_DIR to the folder for the traces "
                           "before the engine starts")


def write_cache_file(path: str, text: str) -> bool:
    """Write a cache file atomically (a temporary file, then a rename: a reader never sees half of
    it), making its folder; False where that fails (a read-only cache only costs start-up time)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        return False
    return True
