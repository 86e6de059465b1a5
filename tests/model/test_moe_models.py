"""Issue 16's mixtures of experts, loaded by our loader, give transformers' logits through a paged
KV cache: Qwen3-MoE (renormalised top-k), Qwen2-MoE (shared expert behind its sigmoid gate, sparse
every second layer), Mixtral (``block_sparse_moe``, ``w1``/``w3``/``w2``), and 32 experts top-8 with a
dense first layer. Per-expert checkpoint tensors are stacked into the fused [E, ...] parameters; a
checkpoint already in transformers' fused layout loads the same; dummy weights load."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.model import load_model, resolve_model
from pagedllm.model.moe import FusedMoE
from tests.conftest import MOE_ARCHS_16, _tiny_config
from tests.model.test_models import _hf_logits
from tests.model.test_new_archs import _our_logits

PROMPT = [(7 * i + 3) % 500 for i in range(40)]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict:
    import transformers

    out = {}
    for arch in MOE_ARCHS_16:
        folder = tmp_path_factory.mktemp(f"moe-{arch}")
        torch.manual_seed(0)
        config = _tiny_config(arch, 512, initializer_range=0.1)
        hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        hf_model.save_pretrained(folder)
        out[arch] = folder, hf_model
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS_16)
def test_moe_logits_match_transformers(moe_checkpoints, arch):
    folder, hf_model = moe_checkpoints[arch]
    model = load_model(resolve_model(str(folder)), "auto", torch.float32, torch.device("cpu"))
    config = hf_model.config
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(blocks) == len(model.moe_layer_indices) == {"qwen2_moe": 2, "qwen3_moe_many": 2}.get(arch, 2)
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    assert blocks[0].gate_up_proj.shape == (num_experts, 2 * inter, 64)
    torch.testing.assert_close(_our_logits(model, PROMPT), _hf_logits(hf_model, PROMPT), atol=1e-4, rtol=1e-4)


def test_qwen2_moe_layer_kinds_follow_sparse_step_and_shared_expert(moe_checkpoints):
    folder, _ = moe_checkpoints["qwen2_moe"]
    model = load_model(resolve_model(str(folder)), "auto", torch.float32, torch.device("cpu"))
    assert model.moe_layer_indices == [1, 3]  # decoder_sparse_step=2
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (256, 64)  # dense: 2 x intermediate 128
    assert model.model.layers[1].mlp.shared_expert.gate_up_proj.weight.shape == (96, 64)
    many, _ = moe_checkpoints["qwen3_moe_many"]
    assert load_model(resolve_model(str(many)), "auto", torch.float32, torch.device("cpu")).moe_layer_indices == [1, 2]


def test_fused_expert_checkpoint_layout_loads_the_same(moe_checkpoints, tmp_path):
    folder, hf_model = moe_checkpoints["qwen3_moe"]
    tensors = load_file(folder / "model.safetensors")
    fused = {}
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([tensors.pop(f"{prefix}.{e}.gate_proj.weight"), tensors.pop(f"{prefix}.{e}.up_proj.weight")])
                   for e in range(8)]
        fused[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.down_proj"] = torch.stack([tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(8)])
    save_file({**tensors, **fused}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    model = load_model(resolve_model(str(tmp_path)), "auto", torch.float32, torch.device("cpu"))
    torch.testing.assert_close(_our_logits(model, PROMPT), _hf_logits(hf_model, PROMPT), atol=1e-4, rtol=1e-4)


def test_missing_expert_tensor_is_reported(moe_checkpoints, tmp_path):
    folder, _ = moe_checkpoints["mixtral"]
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        load_model(resolve_model(str(tmp_path)), "auto", torch.float32, torch.device("cpu"))


def test_dummy_weights_load_and_run(moe_checkpoints):
    folder, _ = moe_checkpoints["qwen2_moe"]
    model = load_model(resolve_model(str(folder)), "dummy", torch.float32, torch.device("cpu"))
    logits = _our_logits(model, PROMPT)
    assert torch.isfinite(logits).all() and logits.std() > 0
