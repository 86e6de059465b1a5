"""int4 experts of a mixture of experts (issue 17 after issue 16): a tiny Qwen3-MoE saved as GPTQ
(zero points stored minus one, or symmetric), AWQ (its [0, 2, 4, 6, 1, 3, 5, 7] packing) and
compressed-tensors pack-quantized (by the library's own compressor, with zero points) write them, one set of tensors per expert and projection as Qwen3-30B-A3B-GPTQ-Int4 ships, attention
quantized too: through the engine (chunked prefill) the greedy tokens and logprobs of a
transformers model holding the same dequantized weights (W4A16_TOL: exact dequant math). The
experts stay packed after loading (int32 words, per-row group scales), and the per-expert
linears they load through are gone."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.model.quantization.int4 import AWQ_ORDER
from tests.model import quant_checkpoints as qc
from tests.model.test_fp8_moe import EXPERTS, LAYERS, _dense_moe, _experts
from tests.model.test_quantization import W4A16_TOL, check_against_reference, make_llm, model_of

GROUP = 32


def _int4_tensors(w: torch.Tensor, fmt: str, symmetric: bool) -> tuple[dict, torch.Tensor]:
    """One projection's checkpoint tensors in ``fmt`` and its dequantized weight."""
    if fmt == "ct":
        return qc.ct_int4_tensors(w, GROUP, symmetric)
    q, s, z = qc.quantize_int4(w, GROUP, symmetric)
    if fmt == "gptq":
        out = {"qweight": qc._pack_gptq_rows(q.t()), "qzeros": qc._pack_cols((z.t() - 1) & 0xF),
               "scales": s.t().half(), "g_idx": torch.arange(q.shape[1], dtype=torch.int32) // GROUP}
    else:
        out = {"qweight": qc._pack_cols(q.t(), AWQ_ORDER), "qzeros": qc._pack_cols(z.t(), AWQ_ORDER),
               "scales": s.t().half()}
    return out, qc.dequant_int4(q, s.half(), z, GROUP)


def write_int4_moe(out_dir, fmt: str, symmetric: bool = False, **overrides):
    """Experts and attention in ``fmt`` ("gptq", "awq", "ct"); returns the reference holding the dequantized weights."""
    model = _dense_moe(out_dir, **overrides)
    tensors = load_file(f"{out_dir}/model.safetensors")
    names = [f"model.layers.{i}.self_attn.{p}" for i in range(LAYERS) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(LAYERS) for e in range(EXPERTS)
              for p in ("gate_proj", "up_proj", "down_proj")]
    dequantized = {}
    for name in names:
        packed, dequantized[name] = _int4_tensors(tensors.pop(name + ".weight"), fmt, symmetric)
        tensors.update({f"{name}.{k}": v.contiguous() for k, v in packed.items()})
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, p).weight.copy_(dequantized[f"model.layers.{i}.self_attn.{p}"])
            for e in range(EXPERTS):
                d = {p: dequantized[f"model.layers.{i}.mlp.experts.{e}.{p}"]
                     for p in ("gate_proj", "up_proj", "down_proj")}
                layer.mlp.experts.gate_up_proj[e].copy_(torch.cat([d["gate_proj"], d["up_proj"]]))
                layer.mlp.experts.down_proj[e].copy_(d["down_proj"])
    save_file(tensors, f"{out_dir}/model.safetensors", metadata={"format": "pt"})
    config = json.loads(open(f"{out_dir}/config.json").read())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": symmetric} if fmt == "gptq"
        else qc.ct_int4_config(GROUP, symmetric) if fmt == "ct"
        else {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"})
    open(f"{out_dir}/config.json", "w").write(json.dumps(config))
    return model


@pytest.mark.parametrize("fmt,symmetric", [("gptq", False), ("gptq", True), ("awq", False), ("ct", False)])
def test_int4_expert_checkpoints_give_the_dequantized_reference(tmp_path, fmt, symmetric):
    reference = write_int4_moe(tmp_path, fmt, symmetric)
    llm = make_llm(str(tmp_path), max_num_batched_tokens=16, max_num_seqs=4)  # every prompt's prefill chunked
    for experts in _experts(llm):
        assert experts.gate_up_proj.dtype == torch.int32 and experts.gate_up_proj.shape == (EXPERTS, 64 // 8, 64)
        assert experts.down_proj.shape == (EXPERTS, 32 // 8, 64) and experts.down_proj_scale.shape == (EXPERTS, 64, 1)
        assert (experts.gate_up_proj_zeros is None) == symmetric and not hasattr(experts, "int4_experts")
    assert model_of(llm).model.layers[0].self_attn.qkv_proj.qweight.dtype == torch.int32
    check_against_reference(llm, reference, W4A16_TOL, exact_greedy=True)
