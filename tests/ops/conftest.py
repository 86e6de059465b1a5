"""Triton kernels under test: compiled on CUDA; elsewhere run by Triton's interpreter on CPU
tensors. TRITON_INTERPRET=1 must be set when triton is first imported (its own helpers such as
tl.sum are kernels too) and while a kernel runs; it is set for those moments only, so tests of
other folders see the environment unchanged. The interpreter truncates float32 -> bfloat16
where the GPU (cvt.rn) and torch round to nearest even; the fixture makes it round like them."""
from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRITON = importlib.util.find_spec("triton") is not None

if DEVICE == "cpu" and HAS_TRITON:
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401

        import pagedllm.ops.triton_ops  # noqa: F401
    finally:
        if _previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture
def triton_ops(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from pagedllm.ops import triton_ops as ops

    if DEVICE == "cpu":
        import triton.language as tl

        if type(tl.sum).__name__ != "InterpretedFunction":
            pytest.fail("triton was imported without TRITON_INTERPRET=1 before tests/ops/conftest.py ran")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        _round_bf16_like_the_gpu(monkeypatch)
        if type(ops._rms_norm_kernel).__name__ != "InterpretedFunction":
            ops = importlib.reload(ops)  # its kernels were defined without the interpreter
    return ops


def _round_bf16_like_the_gpu(monkeypatch) -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(data.view(torch.uint16).numpy(), dst_type.scalar)
        return original(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)
