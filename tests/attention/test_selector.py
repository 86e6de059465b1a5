"""attention.selector: the torch reference off CUDA, PAGEDLLM_ATTENTION_BACKEND forces one, a bad
name is refused with the allowed ones."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention.selector import get_attention_backend


def test_cpu_gets_the_torch_reference_and_the_variable_forces_a_backend(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_ATTENTION_BACKEND", raising=False)
    assert get_attention_backend(torch.device("cpu")).name == "torch"
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", " Torch ")
    assert get_attention_backend(torch.device("cpu")).name == "torch"
    pytest.importorskip("triton")
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    assert get_attention_backend(torch.device("cpu")).name == "triton"


def test_an_unknown_backend_name_is_refused(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match=r"PAGEDLLM_ATTENTION_BACKEND='flash' is not one of \['torch', 'triton'\]"):
        get_attention_backend(torch.device("cpu"))
