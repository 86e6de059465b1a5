"""The benchmarks' --quantization (issue 17): a dummy shape carries each format's
quantization_config (or the engine quantizes it at load), and the roofline's weight bytes equal
the bytes of the parameters the engine holds after loading (packed weights, scales, zero points;
16/32-bit embeddings, norms and LM head)."""
from __future__ import annotations

import json
import os

import pytest

from pagedllm import LLM
from pagedllm.benchmarks import common, latency, throughput
from tests.conftest import TEST_KV_BYTES

KV = f"kv_cache_memory_bytes={TEST_KV_BYTES}"


@pytest.mark.parametrize("shape,quantization", [("tiny-llama", q) for q in [None] + sorted(common.QUANTIZATIONS)]
                         + [("tiny-qwen3-moe", q) for q in sorted(common.QUANTIZATIONS)])  # quantized experts too
def test_weight_bytes_equal_the_loaded_quantized_parameters(shape, quantization):
    overrides, engine_quantization = common.quantization_setup(quantization)
    if quantization == "fp8-block":  # tiny-llama's projections are not all multiples of 128: blocks of 64
        overrides = {"quantization_config": {**overrides["quantization_config"], "weight_block_size": [64, 64]}}
    path = common.write_shape(shape, **overrides)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    llm = LLM(path, load_format="dummy", dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20,
              quantization=engine_quantization)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    params = {id(p): p for p in model.parameters()}.values()
    held = sum(p.numel() * p.element_size() for p in params)
    assert common.weight_bytes(config, itemsize=4, quantization=engine_quantization) == held
    if quantization is not None:  # fewer bytes than the dense shape (the fp32 embeddings dominate this one)
        dense = {k: v for k, v in config.items() if k != "quantization_config"}
        assert held < common.weight_bytes(dense, itemsize=4) - 2_000_000


def test_latency_and_throughput_take_quantization(capsys):
    latency.main(["--shape", "tiny-llama", "--batch-sizes", "1", "--input-len", "8", "--output-len", "3",
                  "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32", "--copy-mib", "8",
                  "--quantization", "gptq", "--engine-args", KV])
    throughput.main(["--shape", "tiny-llama", "--num-prompts", "2", "--max-input-len", "8", "--max-output-len", "3",
                     "--dtype", "float32", "--quantization", "fp8", "--engine-args", KV])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    lat, thr = rows
    assert lat["step_bytes"] == common.step_read_bytes(
        {**common.SHAPES["tiny-llama"], "quantization_config": common.QUANTIZATIONS["gptq"]}, 4, 1, 8 + 3 / 2)
    assert lat["quantization"] == "gptq" and lat["weight_bytes"] == common.weight_bytes(
        {**common.SHAPES["tiny-llama"], "quantization_config": common.QUANTIZATIONS["gptq"]}, 4)
    assert thr["quantization"] == "fp8" and thr["output_tokens"] == 2 * 3
    with pytest.raises(SystemExit):
        latency.main(["--quantization", "int3"])


def test_quant_kernel_smoke_on_cpu(capsys):
    from pagedllm.benchmarks import quant_kernel

    quant_kernel.main(["--tiny", "--rows", "1,3", "--iters", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["projection"], r["rows"]) for r in rows] == [(p, m) for p in ("qkv", "o", "gate_up", "down")
                                                             for m in (1, 3)]
    assert all(r[f"{path}_ms"] > 0 for r in rows for path in ("bf16", "w4a16", "fp8", "fp8_block"))


def test_step_read_bytes_counts_weights_embedding_rows_and_kv():
    cfg = common.SHAPES["llama3-8b"]
    table, kv_per_token = 128256 * 4096 * 2, 32 * 2 * 8 * 128  # bf16 embedding; K and V values per token
    weights = common.weight_bytes(cfg, 2, active_only=True)
    assert common.step_read_bytes(cfg, 2, 1, 256) == weights - table + 4096 * 2 + kv_per_token * 2 * 256
    assert common.step_read_bytes(cfg, 2, 32, 256, kv_itemsize=1) == weights - table + 32 * (4096 * 2 + kv_per_token * 256)
    fp8 = common.weight_bytes(cfg, 2, active_only=True, quantization="fp8")
    assert common.step_read_bytes(cfg, 2, 1, 0, quantization="fp8") == fp8 - table + 4096 * 2
    tied = common.SHAPES["qwen3-0.6b"]  # the tied table is the LM head too: read whole
    assert common.step_read_bytes(tied, 2, 1, 0) == common.weight_bytes(tied, 2) + 1024 * 2
