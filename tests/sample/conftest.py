"""The Triton sampler under test (tests/triton_env.py: the interpreter without a GPU)."""
from __future__ import annotations

import pytest

from tests.triton_env import import_interpreted, kernel_module

import_interpreted("pagedllm.sample.triton_sampler")


@pytest.fixture
def gumbel_sample(monkeypatch):
    return kernel_module("pagedllm.sample.triton_sampler", "_gumbel_argmax_kernel", monkeypatch).gumbel_sample
