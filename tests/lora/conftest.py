"""The LoRA kernels under test (tests/triton_env.py: the interpreter without a GPU)."""
from __future__ import annotations

import pytest

from tests.triton_env import import_interpreted, kernel_module

import_interpreted("pagedllm.ops.triton_lora", "pagedllm.ops.triton_gemv", "pagedllm.ops.triton_ops")


@pytest.fixture
def triton_lora(monkeypatch):
    return kernel_module("pagedllm.ops.triton_lora", "_shrink_kernel", monkeypatch)


@pytest.fixture
def triton_gemv(monkeypatch):
    return kernel_module("pagedllm.ops.triton_gemv", "_small_m_gemm_kernel", monkeypatch)


@pytest.fixture
def triton_ops(monkeypatch):
    return kernel_module("pagedllm.ops.triton_ops", "_rms_norm_kernel", monkeypatch)
