"""Engine defaults. vLLM's token budget per step: the offline LLM on a GPU of 70 GiB or more
(not an A100) takes 16384 tokens a step, the server and everything else 8192. ``dtype="auto"``
on CPU: bfloat16 only with bf16 hardware."""
from __future__ import annotations

import types

import pytest
import torch

from pagedllm.engine import arg_utils


@pytest.mark.parametrize("usage, device, name, gib, expected", [
    ("llm_class", "cuda", "NVIDIA H100 80GB HBM3", 80, 16384),
    ("llm_class", "cuda:1", "NVIDIA H200", 141, 16384),
    ("llm_class", "cuda", "NVIDIA A100-SXM4-80GB", 80, 8192),
    ("llm_class", "cuda", "NVIDIA L4", 24, 8192),
    (None, "cuda", "NVIDIA H100 80GB HBM3", 80, 8192),  # the server, EngineArgs directly
    ("llm_class", "cpu", None, 0, 8192),
])
def test_default_max_num_batched_tokens(monkeypatch, usage, device, name, gib, expected):
    asked = []

    def props(index):
        asked.append(index)
        return types.SimpleNamespace(name=name, total_memory=gib * 2**30)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert arg_utils._default_max_num_batched_tokens(usage, device) == expected
    if usage == "llm_class" and device.startswith("cuda"):
        assert asked == [int(device.partition(":")[2] or 0)]


def test_offline_llm_on_cpu_keeps_8192(tiny_models):
    from pagedllm import LLM
    from tests.conftest import TEST_KV_BYTES

    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES,
              max_model_len=64)
    assert llm.llm_engine.config.scheduler_config.max_num_batched_tokens == 8192


@pytest.mark.parametrize("has_bf16, config_dtype, expected", [
    (True, "bfloat16", "bfloat16"), (True, None, "bfloat16"), (True, "float16", "bfloat16"),
    (True, "float32", "float32"), (False, "bfloat16", "float32"), (False, None, "float32"),
])
def test_auto_dtype_on_cpu_is_bfloat16_only_with_bf16_hardware(monkeypatch, has_bf16, config_dtype, expected):
    from types import SimpleNamespace

    from pagedllm.engine import arg_utils

    monkeypatch.setattr(arg_utils, "cpu_has_bf16_matmul", lambda: has_bf16)
    assert arg_utils._resolve_dtype("auto", SimpleNamespace(dtype=config_dtype), "cpu") == expected
    assert arg_utils._resolve_dtype("float32", SimpleNamespace(dtype=config_dtype), "cpu") == "float32"


def test_auto_dtype_reads_dtype_not_the_deprecated_torch_dtype():
    """transformers 5 logs a deprecation warning whenever `config.torch_dtype` is read; configs of
    older versions keep `torch_dtype` as a plain attribute, which is still honoured."""
    from types import SimpleNamespace

    from pagedllm.engine import arg_utils

    class Config:  # a transformers-5 config with no dtype set (GGUF-derived configs are)
        dtype = None

        @property
        def torch_dtype(self):
            raise AssertionError("torch_dtype read")

    assert arg_utils._resolve_dtype("auto", Config(), "cuda") == "bfloat16"
    assert arg_utils._resolve_dtype("auto", SimpleNamespace(torch_dtype="float16"), "cuda") == "float16"


def test_cpu_bf16_probe_matches_cpuinfo():
    from pagedllm.engine.arg_utils import cpu_has_bf16_matmul

    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert cpu_has_bf16_matmul() == ("avx512_bf16" in flags or "amx_bf16" in flags)
