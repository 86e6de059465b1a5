"""The start-up compile pool (pagedllm.ops.precompile), without a GPU: a compile job like the
ones recorded from Triton's hook is compiled for an H100 target (sm_90) in the pool's forked
processes, into a fresh Triton cache, which the cache lookup then finds. (The GPU test
tests/gpu/test_precompile.py checks the whole start-up: the dry run, and no compile left in
the engine process.) Each case runs in a fresh process: this one holds the kernel modules as
imported for Triton's interpreter (tests/ops/conftest.py), which have no compiled form."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.triton_env import GLUON_PREFILL_SIGNATURE, HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

_CHILD = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from pagedllm.ops import precompile

# A job as collect_compiles records it from Triton's hook: _silu_and_mul_kernel on bf16 rows.
target = GPUTarget("cuda", 90, 32)
options = make_backend(target).parse_options({"num_warps": 4, "num_stages": 3}).__dict__
signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*bf16", "s_ptr": "*bf16", "x_stride0": "i32",
             "inter_size": "i32", "BLOCK": "constexpr", "TRIGGER": "constexpr", "FP8_OUT": "constexpr",
             "ENTER": "constexpr"}
attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
job = ("pagedllm.ops.triton_ops", sys.argv[1], signature, {(6,): 1024, (7,): True, (8,): False, (9,): True}, attrs, options)
before = precompile._in_disk_cache(job, target) if sys.argv[1] == "_silu_and_mul_kernel" else None
pool = precompile.CompilePool(2)
try:
    errors = pool.compile([job], target)
finally:
    pool.close()
after = precompile._in_disk_cache(job, target) if sys.argv[1] == "_silu_and_mul_kernel" else None
print("RESULT " + json.dumps({"before": before, "after": after, "errors": errors}))
"""


def _run(kernel: str, cache_dir) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, "-c", _CHILD, kernel], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads([x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])


def test_pool_compiles_into_the_cache_the_lookup_reads(tmp_path):
    r = _run("_silu_and_mul_kernel", tmp_path)
    assert r == {"before": False, "after": True, "errors": []}
    assert any(p.name.startswith("_silu_and_mul_kernel") for p in tmp_path.rglob("*.cubin"))


_GLUON_CHILD = GLUON_PREFILL_SIGNATURE + r"""
import json
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from pagedllm.attention import gluon_prefill as gp
from pagedllm.ops import precompile

# The Gluon prefill kernel (Hopper's) as the hook records it: its source must be a GluonASTSource, as the JIT's.
target = GPUTarget("cuda", 90, 32)
options = make_backend(target).parse_options({"num_warps": gp.CONFIG["num_warps"]}).__dict__
signature, cons, divisible = gluon_prefill_signature(gp, "bf16", 128)
constants = {(list(signature).index(k),): v for k, v in cons.items()}
attrs = {(list(signature).index(a),): [["tt.divisibility", 16]] for a in divisible}
job = ("pagedllm.attention.gluon_prefill", "prefill_ws_kernel", signature, constants, attrs, options)
before = precompile._in_disk_cache(job, target)
pool = precompile.CompilePool(1)
try:
    errors = pool.compile([job], target)
finally:
    pool.close()
print("RESULT " + json.dumps({"source": type(precompile._source(job)[0]).__name__, "before": before,
                              "after": precompile._in_disk_cache(job, target), "errors": errors}))
"""


def test_pool_compiles_a_gluon_kernel_from_a_gluon_source(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _GLUON_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads([x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert r == {"source": "GluonASTSource", "before": False, "after": True, "errors": []}


def test_pool_reports_a_kernel_it_cannot_compile(tmp_path):
    (error,) = _run("no_such_kernel", tmp_path)["errors"]
    assert "no_such_kernel" in error and "AttributeError" in error


def test_precompiling_can_be_turned_off(monkeypatch):
    from pagedllm.ops import precompile

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert precompile.precompile_available()
    monkeypatch.setenv(precompile.ENV, "0")
    assert not precompile.precompile_available()


_KEPT_CHILD = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from pagedllm.ops import precompile

target = GPUTarget("cuda", 90, 32)
options = make_backend(target).parse_options({"num_warps": 4, "num_stages": 3}).__dict__
options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}  # as the hook hands them
signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*bf16", "s_ptr": "*bf16", "x_stride0": "i32",
             "inter_size": "i32", "BLOCK": "constexpr", "TRIGGER": "constexpr", "FP8_OUT": "constexpr",
             "ENTER": "constexpr"}
attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
job = ("pagedllm.ops.triton_ops", "_silu_and_mul_kernel", signature, {(6,): 1024, (7,): True, (8,): False, (9,): True}, attrs,
       options)
path = precompile.jobs_file("a start-up")
precompile.save_jobs(path, [job])
kept = precompile.load_jobs(path)
pool = precompile.CompilePool(2)
try:
    errors = pool.compile(kept, target)
finally:
    pool.close()
print("RESULT " + json.dumps({"same": kept == [job], "other_file": precompile.jobs_file("another") != path,
                              "errors": errors, "cached": precompile._in_disk_cache(job, target)}))
"""


def test_kept_jobs_read_back_and_compile(tmp_path):
    """A start-up's dry-run jobs are kept as plain literals and read back equal: the next
    start-up with the same key compiles from them (here into an empty Triton cache)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PAGEDLLM_CACHE_DIR": str(tmp_path / "pagedllm")}
    out = subprocess.run([sys.executable, "-c", _KEPT_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads([x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert r == {"same": True, "other_file": True, "errors": [], "cached": True}
    assert len(list((tmp_path / "pagedllm" / "triton_jobs").glob("*.txt"))) == 1


def test_kept_jobs_are_literals_only(tmp_path):
    from pagedllm.ops import precompile

    path = str(tmp_path / "jobs.txt")
    for text in ("__import__('os').system('false')", "[1, 2", "{'a': 1}", ""):
        with open(path, "w") as f:
            f.write(text)
        assert precompile.load_jobs(path) is None, text
    assert precompile.load_jobs(str(tmp_path / "missing.txt")) is None
    precompile.save_jobs(path, [("m", "k", {"x": "*fp32"}, {(1,): 2}, {}, {"num_warps": 4})])
    assert precompile.load_jobs(path) == [("m", "k", {"x": "*fp32"}, {(1,): 2}, {}, {"num_warps": 4})]
    precompile.save_jobs(str(tmp_path / "objects.txt"), [object()])  # not literals: nothing is kept
    assert not (tmp_path / "objects.txt").exists()


def test_kept_job_files_are_bounded(tmp_path, monkeypatch):
    from pagedllm.ops import precompile

    monkeypatch.setattr(precompile, "KEPT_JOB_FILES", 3)
    for i in range(5):
        path = tmp_path / f"{i}.txt"
        precompile.save_jobs(str(path), [("m", "k", {}, {}, {}, {"i": i})])
        os.utime(path, (1000 + i, 1000 + i))  # mtimes in the order written
    assert sorted(p.name for p in tmp_path.glob("*.txt")) == ["2.txt", "3.txt", "4.txt"]



def test_triton_hashes_itself_in_a_background_thread():
    """The worker starts Triton's hash of its own files early (``triton_key``, once per process);
    the first kernel lookup then reads the cached result."""
    from triton.runtime.cache import triton_key

    from pagedllm.ops import precompile

    triton_key.cache_clear()
    thread = precompile.hash_triton_in_background()
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive() and triton_key.cache_info().misses == 1
    key = triton_key()
    assert triton_key.cache_info().hits == 1 and key == triton_key()


def test_pool_forks_as_jobs_come_and_deals_the_rest_round_robin():
    """Jobs are dealt one at a time (the dry run hands each over as it finds it): a process per
    job up to ``max_workers``, then round-robin; every reply comes back once the pool finishes."""
    from triton.backends.compiler import GPUTarget

    from pagedllm.ops import precompile

    target = GPUTarget("cuda", 90, 32)
    jobs = [("pagedllm.ops.triton_ops", f"no_kernel_{i}", {}, {}, {}, {}) for i in range(5)]
    pool = precompile.CompilePool(2)
    try:
        pool.submit(jobs[0], target)
        assert pool.num_workers == 1
        for job in jobs[1:]:
            pool.submit(job, target)
        assert pool.num_workers == 2
        errors = pool.finish(timeout_s=120)
    finally:
        pool.close()
    assert sorted(e.split(":")[0] for e in errors) == [f"no_kernel_{i}" for i in range(5)]
