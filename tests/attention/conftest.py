"""The Triton attention kernels under test (tests/triton_env.py: the interpreter without a GPU)."""
from __future__ import annotations

import pytest

from tests.triton_env import HAS_TRITON, ON_GPU, import_interpreted, kernel_module  # noqa: F401

import_interpreted("pagedllm.attention.triton_kernels")


@pytest.fixture
def kernels(monkeypatch):
    """pagedllm.attention.triton_kernels, runnable on this machine (the interpreter on CPU)."""
    return kernel_module("pagedllm.attention.triton_kernels", "_attention_kernel", monkeypatch)
