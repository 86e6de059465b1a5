"""Triton kernels under test: compiled on CUDA; elsewhere run by Triton's interpreter on CPU
tensors. TRITON_INTERPRET=1 must be set when triton (whose own helpers such as tl.max are
kernels too) and a kernel module are first imported, and while a kernel runs; it is set for
those moments only, so tests of other folders see the environment unchanged."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _patch_interpreter_index() -> None:
    """Loop bounds read from tensors need ``__index__`` on the interpreter's scalar tensors;
    triton 3.6 takes ``int()`` of a 1-element array there, an error under numpy 2."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_pagedllm_index_patched", False) or not hasattr(interp, "_patch_lang_tensor"):
        return
    original = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch_lang_tensor
    interp._pagedllm_index_patched = True


def import_interpreted(*module_names: str) -> None:
    """Without a GPU, import triton and these kernel modules with the interpreter on (a conftest
    calls this at import time, before any test module imports them)."""
    if ON_GPU or not HAS_TRITON:
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401

        _patch_interpreter_index()
        for name in module_names:
            importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def kernel_module(name: str, kernel: str, monkeypatch):
    """The kernel module ``name``, runnable here: on CPU with the interpreter on for the test
    and bfloat16 computed as the GPU computes it. Skips without triton."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    module = importlib.import_module(name)
    if not ON_GPU:
        if type(getattr(module, kernel)).__name__ != "InterpretedFunction":
            pytest.fail(f"{name} was imported without TRITON_INTERPRET=1 before its folder's conftest ran")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        _bf16_like_the_gpu(monkeypatch)
    return module


def _bf16_like_the_gpu(monkeypatch) -> None:
    """The interpreter keeps bfloat16 as raw uint16: its dot and its arithmetic work on those
    integers, and its float32 -> bfloat16 (and -> fp8) casts truncate where the GPU (cvt.rn)
    rounds to nearest even. All are made to compute what the GPU computes, for the duration of a
    test."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def as_float32(handle):
        if handle.dtype.scalar == tl.bfloat16:
            return torch.from_numpy(handle.data.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
        return handle.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar != tl.bfloat16 and b.dtype.scalar != tl.bfloat16:
            return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.matmul(as_float32(a), as_float32(b), dtype=np.float32).astype(d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    def as_bfloat16(values):  # float32 values -> a bfloat16 handle, rounded to nearest even
        data = torch.from_numpy(np.asarray(values, dtype=np.float32)).to(torch.bfloat16)
        return interpreter.TensorHandle(data.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return as_bfloat16(src.data)
        return original_cast(self, src, dst_type)

    def binary_op(self, lhs, rhs, op):  # bfloat16 arithmetic and comparisons on the values, not the bits
        if lhs.dtype.scalar != tl.bfloat16 or rhs.dtype.scalar != tl.bfloat16:
            return original_binary_op(self, lhs, rhs, op)
        out = np.asarray(op(as_float32(lhs), as_float32(rhs)))
        if out.dtype == np.bool_:  # a comparison: 0 / 1 in the operands' storage, as the interpreter keeps it
            return interpreter.TensorHandle(out.astype(np.uint16), tl.bfloat16)
        return as_bfloat16(out)  # the GPU's add/sub/mul.rn.bf16x2

    # fp8 casts: the interpreter truncates to fp8 (and rebuilds subnormals by hand) where the GPU's
    # cvt.rn rounds to nearest even; torch's casts are what the GPU computes (widening is exact).
    fp8_types = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    wide_types = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}

    def to_torch(handle):
        scalar = handle.dtype.scalar
        data = torch.from_numpy(np.ascontiguousarray(handle.data))
        return data.view(fp8_types[scalar]) if scalar in fp8_types else \
            data.view(torch.bfloat16) if scalar == tl.bfloat16 else data

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_t, dst_t = src.dtype.scalar, dst_type.scalar
        known = {**fp8_types, **wide_types}
        if (src_t in fp8_types or dst_t in fp8_types) and src_t in known and dst_t in known:
            out = to_torch(src).to(known[dst_t])
            if dst_t in fp8_types:
                out = out.view(torch.uint8)
            elif dst_t == tl.bfloat16:
                out = out.view(torch.int16)
            return interpreter.TensorHandle(out.numpy().view(interpreter._get_np_dtype(dst_t)), dst_t)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    original_dot = interpreter.InterpreterBuilder.create_dot
    original_cast = interpreter.InterpreterBuilder.cast_impl
    original_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp
    original_binary_op = interpreter.InterpreterBuilder.binary_op
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "binary_op", binary_op)


# The head of a child script that compiles kernels for an H100 (sm_90: TTIR -> PTX -> cubin with
# the ptxas Triton ships) without a GPU; the script fills ``results`` (name -> True or the error).
_SM90_PRELUDE = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

target = GPUTarget("cuda", 90, 32)
results = {}
c = "constexpr"

def compile_(name, fn, signature, constexprs, num_warps=4, options=None, want_ptx=None, divisible=(), gluon=False):
    # divisible: the arguments a launch would find 16-divisible (pointers, strides), which is
    # what lets Triton vectorise and pipeline their loads; gluon: fn is a Gluon kernel (no pipeliner stages)
    attrs = {(list(signature).index(a),): [["tt.divisibility", 16]] for a in divisible}
    try:
        if gluon:
            from triton.experimental.gluon._runtime import GluonASTSource as Source
        source = (Source if gluon else ASTSource)(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(source, target=target,
                                options={"num_warps": num_warps, **({} if gluon else {"num_stages": 3}), **(options or {})})
        wanted = [want_ptx] if isinstance(want_ptx, str) else want_ptx or []  # a string or several
        results[name] = "cubin" in kernel.asm and all(w in kernel.asm["ptx"] for w in wanted)
    except Exception as e:  # the test prints what the compiler said
        results[name] = f"{type(e).__name__}: {str(e)[:800]}"
"""


# The signatures of triton_ops' RMSNorm and SiLU-and-mul kernels (bf16 rows, fp8 quantized rows), for
# the bodies of compile_for_sm90 that compile them (the LoRA chain, the decode chain).
SM90_NORM_SILU = r"""
norm = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
        "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "n_inner": "i32", "x_stride0": "i32", "x_stride1": "i32",
        "res_stride0": "i32", "res_stride1": "i32", "N": "i32", "eps": "fp32", "HAS_RESIDUAL": c, "BLOCK": c,
        "TRIGGER": c, "FP8_OUT": c, "ENTER": c}
silu = {"x_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "x_stride0": "i32",
        "inter_size": "i32", "BLOCK": c, "TRIGGER": c, "FP8_OUT": c, "ENTER": c}
"""


def compile_for_sm90(body: str, cache_dir) -> dict:
    """Runs ``body`` (calls of ``compile_(name, fn, signature, constexprs, ...)``) in a fresh
    process: the test's own holds the kernel modules as imported for the interpreter, which
    have no compiled form. Triton's cache is ``cache_dir``. Returns ``results``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache_dir)}
    script = _SM90_PRELUDE + body + "\nprint(json.dumps(results))\n"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


# A function for the child scripts that compile the Gluon prefill kernel (attention/gluon_prefill.py) without a
# GPU: its signature for a ``dt`` ("bf16" / "fp16") cache and head_dim ``hd``, in the kernel's argument order, its
# constexprs (the module's CONFIG) and the arguments a launch on the engine's tensors finds 16-divisible.
GLUON_PREFILL_SIGNATURE = r"""
def gluon_prefill_signature(gp, dt, hd):
    ptrs = ("q_ptr", "out_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr", "qsl_ptr")
    cons = dict(NUM_HEADS=32, GROUP=4, BLOCK_SIZE=16, HEAD_DIM=hd, Q_LEN_THRESHOLD=16,
                **{k: v for k, v in gp.CONFIG.items() if k != "num_warps"})

    def kind(a):
        if a in cons:
            return "constexpr"
        if a in ptrs:
            return "*i32" if a in ("block_tables_ptr", "seq_lens_ptr", "qsl_ptr") else "*" + dt
        return "fp32" if a == "scale_log2" else "i32"

    sig = {a: kind(a) for a in gp.prefill_ws_kernel.arg_names}
    divisible = [a for a in sig if a in ptrs or (a.startswith("stride") and a != "stride_bt")]
    return sig, cons, divisible
"""
