"""The start-up compile pool (pagedllm.ops.precompile), without a GPU: a specialization record
like the one Triton's hook hands over is compiled for an H100 target (sm_90) in the pool's
subprocesses, into a fresh Triton cache, which the cache lookup then finds. (The GPU test
tests/gpu/test_precompile.py checks the whole start-up: the dry run, and no compile left in
the engine process.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.triton_env import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _silu_record():
    """What JITFunction's hook reports for _silu_and_mul_kernel on bf16 rows, for sm_90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 4, "num_stages": 3})
    signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "x_stride0": "i32", "inter_size": "i32", "BLOCK": "constexpr"}
    constants = {(4,): 1024}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]],
             (3,): [["tt.divisibility", 16]]}
    spec = serialize_specialization_data("pagedllm.ops.triton_ops._silu_and_mul_kernel", signature, constants,
                                         attrs, options, "key")
    return ("pagedllm.ops.triton_ops", "_silu_and_mul_kernel", spec), target


def _in_disk_cache(job, target) -> bool:
    """The engine's cache lookup, in a fresh process: this one holds the kernel modules as
    imported for Triton's interpreter (tests/ops/conftest.py), which have no compiled form."""
    code = ("import json, sys; from triton.backends.compiler import GPUTarget; "
            "from pagedllm.ops.precompile import _in_disk_cache; job, t = json.loads(sys.argv[1]); "
            "print(_in_disk_cache(*job, GPUTarget(*t)))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([job, [target.backend, target.arch,
                                                                     target.warp_size]])],
                         capture_output=True, text=True, check=True).stdout.split()
    return {"True": True, "False": False}[out[-1]]


def test_pool_compiles_into_the_cache_the_lookup_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # the subprocesses inherit it
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from pagedllm.ops import precompile

    job, target = _silu_record()
    assert not _in_disk_cache(job, target)
    pool = precompile.CompilePool(2)
    try:
        assert pool.compile([job], target) == []
    finally:
        pool.close()
    assert _in_disk_cache(job, target)
    assert any(p.name.startswith("_silu_and_mul_kernel") for p in tmp_path.rglob("*.cubin"))


def test_pool_reports_a_kernel_it_cannot_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from pagedllm.ops import precompile

    (module, _, spec), target = _silu_record()
    pool = precompile.CompilePool(1)
    try:
        errors = pool.compile([(module, "no_such_kernel", spec)], target)
    finally:
        pool.close()
    assert len(errors) == 1 and "no_such_kernel" in errors[0] and "AttributeError" in errors[0]


def test_precompiling_can_be_turned_off(monkeypatch):
    from pagedllm.ops import precompile

    monkeypatch.setenv(precompile.ENV, "0")
    assert precompile.start_compile_pool() is None
