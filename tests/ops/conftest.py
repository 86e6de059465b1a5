"""The Triton ops under test (tests/triton_env.py: the interpreter without a GPU)."""
from __future__ import annotations

import pytest

from tests.triton_env import ON_GPU, import_interpreted, kernel_module

DEVICE = "cuda" if ON_GPU else "cpu"

import_interpreted("pagedllm.ops.triton_ops", "pagedllm.ops.triton_gemv", "pagedllm.ops.triton_moe_routing",
                  "pagedllm.ops.triton_fused_moe",
                  "pagedllm.ops.triton_int4_swap", "pagedllm.ops.triton_int4", "pagedllm.ops.triton_fp8")


@pytest.fixture
def triton_ops(monkeypatch):
    return kernel_module("pagedllm.ops.triton_ops", "_rms_norm_kernel", monkeypatch)


@pytest.fixture
def triton_gemv(monkeypatch):
    return kernel_module("pagedllm.ops.triton_gemv", "_small_m_gemm_kernel", monkeypatch)


@pytest.fixture
def triton_fused_moe(monkeypatch):
    return kernel_module("pagedllm.ops.triton_fused_moe", "_moe_gate_up_kernel", monkeypatch)


@pytest.fixture
def triton_moe_routing(monkeypatch):
    return kernel_module("pagedllm.ops.triton_moe_routing", "_route_kernel", monkeypatch)


@pytest.fixture
def triton_int4(monkeypatch):
    return kernel_module("pagedllm.ops.triton_int4", "_w4a16_gemm_kernel", monkeypatch)


@pytest.fixture
def triton_fp8(monkeypatch):
    return kernel_module("pagedllm.ops.triton_fp8", "_fp8_block_gemm_kernel", monkeypatch)
