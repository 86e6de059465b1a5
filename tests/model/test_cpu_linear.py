"""The CPU linear path (oneDNN through torch) against F.linear, and its switch."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model import layers
from pagedllm.ops import cpu_linear


@pytest.mark.parametrize("shape", [(0, 96), (1, 96), (32, 96), (2, 5, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_linear_matches_f_linear_in_float32(shape, with_bias):
    torch.manual_seed(0)
    x, w = torch.randn(*shape), torch.randn(200, 96)
    b = torch.randn(200) if with_bias else None
    out = layers.linear(x, w, b)
    assert out.shape == (*shape[:-1], 200) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_cpu_linear_takes_non_contiguous_input_and_bfloat16():
    torch.manual_seed(0)
    x, w = torch.randn(8, 192)[:, ::2], torch.randn(64, 96)
    torch.testing.assert_close(layers.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    xb, wb = x.bfloat16(), w.bfloat16()
    out = layers.linear(xb, wb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(xb, wb).float(), rtol=2e-2, atol=1e-1)


def test_cpu_linear_uses_onednn_unless_disabled(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    calls = []
    real = F.linear
    monkeypatch.setattr(cpu_linear.F, "linear", lambda *a: calls.append(1) or real(*a))
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    monkeypatch.setattr(cpu_linear, "_ENABLED", None)
    layers.linear(x, w)
    assert calls == []  # oneDNN's kernel, not F.linear
    monkeypatch.setenv(cpu_linear.DISABLE_ENV, "0")
    monkeypatch.setattr(cpu_linear, "_ENABLED", None)
    layers.linear(x, w)
    assert calls == [1]
    monkeypatch.delenv(cpu_linear.DISABLE_ENV)
    monkeypatch.setattr(cpu_linear, "_ENABLED", None)
    assert layers.linear(x.requires_grad_(True), w).requires_grad  # autograd needs F.linear
    assert calls == [1, 1]


def test_parameters_are_prepacked_and_repacked_when_their_weights_move(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(cpu_linear, "_ENABLED", None)
    cpu_linear.forget_packed()
    torch.manual_seed(0)
    x = torch.randn(32, 96)
    w = torch.nn.Parameter(torch.randn(200, 96), requires_grad=False)
    torch.testing.assert_close(layers.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    entry = cpu_linear._PACKS[id(w)]
    assert entry[2] is not None and cpu_linear._PACKED_BYTES == w.numel() * 4
    layers.linear(x, w)
    assert cpu_linear._PACKS[id(w)] is entry  # the pack is reused
    w.data = torch.randn(200, 96)  # new storage (sleep mode's restore): repacked on use
    torch.testing.assert_close(layers.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert cpu_linear._PACKED_BYTES == w.numel() * 4
    with torch.no_grad():
        w.data.copy_(torch.randn(200, 96))  # in place: the worker forgets the packs after such writes
    cpu_linear.forget_packed()
    torch.testing.assert_close(layers.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    plain = torch.randn(200, 96)  # not a Parameter (an expert's slice, a dequantized weight): never packed
    layers.linear(x, plain)
    assert id(plain) not in cpu_linear._PACKS
    key = id(w)
    del entry, w  # a weight dropped (its model gone): its pack and its share of the budget go too
    gc.collect()
    assert key not in cpu_linear._PACKS and cpu_linear._PACKED_BYTES == 0
    cpu_linear.forget_packed()
