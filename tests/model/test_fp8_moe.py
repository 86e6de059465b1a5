"""FP8 experts of a mixture of experts (issue 17 after issue 16): a tiny Qwen3-MoE whose experts
are saved in fp8 as Qwen3-30B-A3B-FP8 ships them (per-expert tensors, per-tensor ``weight_scale``
or block-wise ``weight_scale_inv``), its attention left dense (``ignored_layers``), gives through
the engine (chunked prefill, prefix caching) the greedy tokens and logprobs of a transformers
model holding the same dequantized experts (within W4A16_TOL: the experts run W8A16, exact
dequant math); online ``quantization="fp8"`` quantizes the experts per channel at load and,
with the attention's W8A8 fake-quantized in the reference, stays within W8A8's bounds. The
experts stay fp8 in memory; a format the experts cannot run is refused by name."""
from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.model.quantization.fp8 import quantize_weight_per_channel
from tests.conftest import _tiny_config
from tests.model import quant_checkpoints as qc
from tests.model.test_quantization import W4A16_TOL, W8A8_TOL, check_against_reference, make_llm, model_of

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
LAYERS, EXPERTS = 2, 8


def _dense_moe(out_dir, **overrides):
    import transformers

    torch.manual_seed(0)
    config = _tiny_config("qwen3_moe", 512, initializer_range=0.1, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out_dir)
    return model


def _quantize(w: torch.Tensor, block: int | None, j: int):
    """(fp8 weight, scale tensor as the checkpoint stores it, dequantized weight)."""
    if block is None:  # per tensor, not always the tightest scale
        scale = w.abs().max() / FP8_MAX * (1.0 + 0.1 * (j % 3))
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return q, scale.reshape(()), q.float() * scale
    n, k = w.shape
    tiles = w.view(n // block, block, k // block, block)
    scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(n, k), scale, (q.float() * scale[:, None, :, None]).view(n, k)


def write_fp8_moe(out_dir, block: int | None):
    """The experts in fp8 (the attention dense); returns the reference holding the dequantized experts."""
    model = _dense_moe(out_dir)
    tensors = load_file(f"{out_dir}/model.safetensors")
    for layer in range(LAYERS):
        experts = model.model.layers[layer].mlp.experts
        for e in range(EXPERTS):
            dq = {}
            for j, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                q, scale, dq[proj] = _quantize(tensors[name + ".weight"], block, e + j)
                tensors[name + ".weight"] = q
                tensors[name + (".weight_scale" if block is None else ".weight_scale_inv")] = scale
            with torch.no_grad():
                experts.gate_up_proj[e].copy_(torch.cat([dq["gate_proj"], dq["up_proj"]]))
                experts.down_proj[e].copy_(dq["down_proj"])
    tensors["model.layers.0.mlp.experts.0.gate_proj.input_scale"] = torch.tensor(0.02)  # unused: W8A16 experts
    save_file(tensors, f"{out_dir}/model.safetensors", metadata={"format": "pt"})
    config = json.loads(open(f"{out_dir}/config.json").read())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "ignored_layers": ["self_attn"],
                                     **({"weight_block_size": [block, block]} if block else {})}
    open(f"{out_dir}/config.json", "w").write(json.dumps(config))
    return model


def _experts(llm):
    return [m.mlp.experts for m in model_of(llm).model.layers]


@pytest.mark.parametrize("block", [None, 16])
def test_fp8_expert_checkpoints_give_the_dequantized_reference(tmp_path, block):
    reference = write_fp8_moe(tmp_path, block)
    llm = make_llm(str(tmp_path), max_num_batched_tokens=16, max_num_seqs=4)  # every prompt's prefill chunked
    for experts in _experts(llm):
        assert experts.gate_up_proj.dtype == FP8 and experts.down_proj.dtype == FP8
        want = (EXPERTS, 64, 64 // 16) if block else (EXPERTS, 64)  # 2 x intermediate 32 rows (in blocks)
        assert tuple(experts.gate_up_proj_scale.shape) == (want[0], want[1] // (block or 1), *want[2:])
    attention = model_of(llm).model.layers[0].self_attn.qkv_proj
    assert attention.weight.dtype == torch.float32  # ignored_layers: dense
    check_against_reference(llm, reference, W4A16_TOL, exact_greedy=True)


def test_online_fp8_quantizes_the_experts_per_channel(tmp_path):
    reference = _dense_moe(tmp_path)
    checkpoint = load_file(f"{tmp_path}/model.safetensors")
    llm = make_llm(str(tmp_path), quantization="fp8", max_num_batched_tokens=16, max_num_seqs=4)
    hooks = {}
    for layer, experts in enumerate(_experts(llm)):
        prefix = f"model.layers.{layer}.mlp.experts.3"
        gate_up = torch.cat([checkpoint[f"{prefix}.gate_proj.weight"], checkpoint[f"{prefix}.up_proj.weight"]])
        q, scale = quantize_weight_per_channel(gate_up.to(experts.gate_up_proj.device))  # the engine's arithmetic
        assert torch.equal(experts.gate_up_proj[3].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(experts.gate_up_proj_scale[3], scale) and experts.down_proj_scale.shape == (EXPERTS, 64)
        hf = reference.model.layers[layer]
        with torch.no_grad():  # the reference: experts dequantized, attention W8A8 (inputs fake-quantized)
            for e in range(EXPERTS):
                for name in ("gate_up_proj", "down_proj"):
                    ours = getattr(experts, name)[e].float() * getattr(experts, f"{name}_scale")[e, :, None]
                    getattr(hf.mlp.experts, name)[e].copy_(ours)
            # (copy_ brings the engine's tensors to the reference's device)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                hooks[f"model.layers.{layer}.self_attn.{proj}"] = qc.fake_quant_per_token
                dense = getattr(hf.self_attn, proj)
                q, scale = quantize_weight_per_channel(dense.weight)
                dense.weight.copy_(q.float() * scale[:, None])
    qc.add_input_hooks(reference, hooks)
    weight_bytes = sum(p.numel() * p.element_size() for e in _experts(llm) for p in e.parameters())
    assert weight_bytes == LAYERS * EXPERTS * (3 * 32 * 64 + 4 * (2 * 32 + 64))  # fp8 values + float32 scales
    check_against_reference(llm, reference, W8A8_TOL, exact_greedy=False)


def test_expert_formats_the_kernels_cannot_run_are_refused(tmp_path):
    """GGUF experts have no kernel: their MoE checkpoints are refused before any worker starts.
    (int4 experts run under expert parallelism too: tests/distributed/test_tensor_parallel_quant.py.)"""
    from pagedllm import EngineArgs
    from pagedllm.engine.model_options import model_quantization
    from pagedllm.model import resolve_model

    _dense_moe(tmp_path / "dense")
    args = EngineArgs(model=str(tmp_path / "dense"), quantization="gguf")
    resolved = types.SimpleNamespace(hf_config=resolve_model(str(tmp_path / "dense")).hf_config, gguf_file="x.gguf")
    with pytest.raises(ValueError, match=r"quantization 'gguf' is not supported for the experts of mixture-of-experts "
                                         r"models \(Qwen3MoeForCausalLM\); supported there: fp8"):
        model_quantization(args, resolved)
