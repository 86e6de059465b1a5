"""The LoRA kernels under test (tests/triton_env.py: the interpreter without a GPU); the
small-row GEMM and linear dispatch that carry the LoRA epilogue come with tests/ops' fixtures."""
from __future__ import annotations

import pytest

from tests.ops.conftest import triton_gemv, triton_ops  # noqa: F401  (fixtures; imports them interpreted)
from tests.triton_env import import_interpreted, kernel_module

import_interpreted("pagedllm.ops.triton_lora")


@pytest.fixture
def triton_lora(monkeypatch):
    return kernel_module("pagedllm.ops.triton_lora", "_shrink_kernel", monkeypatch)
