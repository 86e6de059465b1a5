"""The bitmask kernel under test (tests/triton_env.py: the interpreter without a GPU)."""
from __future__ import annotations

import pytest

from tests.triton_env import import_interpreted, kernel_module

import_interpreted("pagedllm.structured_output.triton_bitmask")


@pytest.fixture
def triton_bitmask(monkeypatch):
    return kernel_module("pagedllm.structured_output.triton_bitmask", "_apply_bitmask_kernel", monkeypatch)


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
