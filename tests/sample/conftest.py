"""The Triton sampler under test: compiled on CUDA, run by Triton's interpreter elsewhere
(set only while importing the kernel module and while a test runs, as in tests/attention)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

if not ON_GPU and HAS_TRITON:
    from tests.attention.conftest import _patch_interpreter

    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401

        _patch_interpreter()
        import pagedllm.sample.triton_sampler  # noqa: F401
    finally:
        if _previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture
def gumbel_sample(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from pagedllm.sample import triton_sampler

    if not ON_GPU:
        if type(triton_sampler._gumbel_argmax_kernel).__name__ != "InterpretedFunction":
            pytest.fail("triton_sampler was imported without TRITON_INTERPRET=1 before this conftest")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return triton_sampler.gumbel_sample
