"""LoRA adapters on a quantized base and on a mixture-of-experts base.

Quantized: the adapters' delta is added to the quantized projection's output, from the layer's
unquantized input (what peft's LoRA layer sees: W8A8 quantizes the activation for the base GEMM
only). Pinned against peft on the transformers model holding the dequantized weights (fp32,
W8A8's base projections' inputs fake-quantized by pre-hooks, tests/model/quant_checkpoints.py):
W4A16 greedy tokens identical, adapter on all seven projections; W8A8 (per-tensor and block-wise
fp8) each adapted layer equal to peft's on the same input, and greedy tokens identical; the
real SmolLM2 GGUF (Q4_1) against peft over transformers' GGUF loader.

MoE: an adapter on the attention projections gives peft's greedy tokens; one on the experts
(peft's fused ``target_parameters``, per-expert modules, Mixtral's ``w1``, a shared expert) is
refused before the engine sees it, and the engine serves on."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams, TokensPrompt
from tests.model import quant_checkpoints as qc

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
PROMPTS = [[5, 17, 99, 3, 250], [7] * 3 + list(range(20, 60)), [400, 401, 3, 9, 12, 77, 300, 8, 9, 10, 11]]
MAX_TOKENS = 8
QUANTIZED = {  # weight-only int4 formats (GPTQ: tests/model/test_quantization.py), fp8 W8A8 (per-token activations)
    "awq": lambda d: qc.write_awq(d, group=64),
    "ct-w4a16": lambda d: qc.write_ct_int4(d, group=32, symmetric=True),
    "fp8-w8a8": lambda d: qc.write_fp8(d, "dynamic"),
    "fp8-block-w8a8": lambda d: qc.write_fp8_block(d),  # weight_scale_inv blocks, per-token-group activations
}


def _peft(base, out_dir: str, targets: list[str], seed: int = 0):
    """``base`` wrapped by a peft adapter with random A and B (B scaled up so the tokens move), saved."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0,
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(out_dir)
    return model.eval()


@torch.no_grad()
def _greedy(model) -> list[list[int]]:
    return [model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(ids):].tolist() for ids in PROMPTS]


def _generate(llm: LLM, lora: LoRARequest | None) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False, lora_request=lora)
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(path: str) -> LLM:
    return LLM(path, dtype="float32", seed=0, skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20,
               enable_lora=True, max_lora_rank=8, max_loras=1, max_model_len=128)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up_proj": ("gate_proj", "up_proj"),
          "down_proj": ("down_proj",)}


@torch.no_grad()
def _check_layers(llm: LLM, peft_model, lora: LoRARequest) -> None:
    """Every adapted layer with the adapter mapped to all rows equals peft's LoRA layers (whose
    base layers carry the W8A8 reference's input hooks) on the same random input."""
    from pagedllm.lora.layers import set_mapping
    from pagedllm.model.layers import Linear

    runner, modules = _runner(llm), dict(peft_model.base_model.model.named_modules())
    slot = runner.lora.activate({lora.lora_int_id})[lora.lora_int_id]
    g = torch.Generator().manual_seed(0)
    set_mapping(np.full(7, slot), torch.device("cpu"))
    try:
        for name, layer in runner.model.named_modules():
            if not isinstance(layer, Linear) or layer.lora is None:
                continue
            parent, fused = name.rsplit(".", 1)
            x = torch.randn(7, layer.in_features, generator=g)
            want = torch.cat([modules[f"{parent}.{part}"](x) for part in _FUSED[fused]], dim=-1)
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    finally:
        set_mapping(None, torch.device("cpu"))


@pytest.mark.parametrize("fmt", list(QUANTIZED))
def test_an_adapter_on_a_quantized_base_gives_peft_tokens_on_the_dequantized_model(tmp_path, fmt):
    reference = QUANTIZED[fmt](str(tmp_path / "model"))
    base_tokens = _greedy(reference)
    peft_model = _peft(reference, str(tmp_path / "adapter"), ALL)
    want = _greedy(peft_model)
    assert want != base_tokens  # the adapter changes the outputs
    llm = _llm(str(tmp_path / "model"))
    assert _runner(llm).model.quant_config is not None
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    assert _generate(llm, lora) == want
    if fmt.endswith("w8a8") and _runner(llm).device.type == "cpu":
        _check_layers(llm, peft_model, lora)  # the adapter reads the unquantized activation, as peft's does
    assert _generate(llm, None) == base_tokens


def test_an_adapter_on_the_gguf_base_gives_peft_tokens_on_transformers_gguf_model(smollm2_gguf, tmp_path):
    """The real SmolLM2 Q4_1 GGUF as the base: peft over transformers' own GGUF loader (its
    dequantized weights) is the reference."""
    import os

    from transformers import AutoModelForCausalLM

    from pagedllm.model.loader import resolve_model

    resolved = resolve_model(smollm2_gguf)
    reference = AutoModelForCausalLM.from_pretrained(resolved.path, gguf_file=os.path.basename(smollm2_gguf),
                                                     config=resolved.hf_config, dtype=torch.float32).eval()
    base_tokens = _greedy(reference)
    peft_model = _peft(reference, str(tmp_path / "adapter"), ALL)
    want = _greedy(peft_model)
    assert want != base_tokens
    llm = LLM(smollm2_gguf, dtype="float32", seed=0, skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20,
              enable_lora=True, max_lora_rank=8, max_loras=1, max_model_len=128)
    assert _generate(llm, LoRARequest("a", 1, str(tmp_path / "adapter"))) == want
    assert _generate(llm, None) == base_tokens


# ---- mixture-of-experts base -----------------------------------------------------------------

@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts top 2, a dense first layer) and an engine over it."""
    import transformers

    folder = str(tmp_path_factory.mktemp("qwen3-moe"))
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
                                      norm_topk_prob=True, initializer_range=0.1, tie_word_embeddings=False,
                                      dtype="float32")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder, _llm(folder)


def _moe_base(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_an_attention_adapter_on_a_moe_base_gives_peft_tokens(moe, tmp_path):
    folder, llm = moe
    base_tokens = _greedy(_moe_base(folder))
    want = _greedy(_peft(_moe_base(folder), str(tmp_path / "attn"), ATTENTION))
    assert want != base_tokens
    assert _generate(llm, LoRARequest("attn", 1, str(tmp_path / "attn"))) == want
    assert _generate(llm, None) == base_tokens


def _in_memory(modules: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Rank-4 LoRA tensors for ``modules`` (name: (in, out)), peft's key layout."""
    tensors = {}
    for name, (fan_in, fan_out) in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(4, fan_in)
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(fan_out, 4)
    return tensors


def test_adapters_on_moe_experts_are_refused_by_name_and_the_engine_serves_on(moe, tmp_path):
    folder, llm = moe
    peft_cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    attn = {"model.layers.1.self_attn.q_proj": (64, 64)}
    refused = {  # a transformers-4 per-expert adapter; Mixtral's naming; a shared expert; a sparse layer's MLP
        "expert": {**attn, "model.layers.1.mlp.experts.2.gate_proj": (64, 32)},
        "mixtral": {"model.layers.1.block_sparse_moe.experts.0.w1": (64, 32)},
        "shared": {"model.layers.1.mlp.shared_expert.up_proj": (64, 32)},
        "sparse-mlp": {"model.layers.1.mlp.down_proj": (96, 64)},
    }
    for i, (name, modules) in enumerate(refused.items()):
        lora = LoRARequest(name, 10 + i, tensors=_in_memory(modules), peft_config=peft_cfg)
        with pytest.raises(ValueError, match=r"targets 'model\.layers\.1\..*': LoRA on MoE experts is not supported"):
            _generate(llm, lora)
    # peft itself adapts transformers' fused experts by their parameters (target_parameters)
    _peft(_moe_base(folder), str(tmp_path / "all"), ALL)
    with pytest.raises(ValueError, match=r"target_parameters=.*gate_up_proj.*LoRA on MoE experts is not supported"):
        _generate(llm, LoRARequest("all", 20, str(tmp_path / "all")))
    # the dense layer's MLP takes an adapter (model.layers.0: mlp_only_layers)
    dense = {"model.layers.0.mlp.gate_proj": (64, 96), "model.layers.0.mlp.down_proj": (96, 64)}
    assert llm.add_lora(LoRARequest("dense", 21, tensors=_in_memory(dense), peft_config=peft_cfg))
    assert len(_generate(llm, LoRARequest("dense", 21))[0]) == MAX_TOKENS
    assert _generate(llm, None) == _greedy(_moe_base(folder))
    core = llm.llm_engine.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def test_an_adapter_on_a_moe_base_s_dense_mlp_gives_the_merged_model_s_tokens(moe):
    """The dense layer's MLP (mlp_only_layers) is a plain gate/up/down, adapted as in a dense model.
    peft 0.21 turns gate/up/down targets on a transformers-5 MoE model into its expert
    ``target_parameters`` (the sparse layers' experts, not this MLP), so the reference is the
    transformers model with the adapter merged into those three weights: W + (alpha / r) B A."""
    folder, llm = moe
    torch.manual_seed(1)
    dense = {f"model.layers.0.mlp.{p}": shape for p, shape in
             (("gate_proj", (64, 96)), ("up_proj", (64, 96)), ("down_proj", (96, 64)))}
    tensors = {k: v * 0.5 for k, v in _in_memory(dense).items()}
    merged = _moe_base(folder)
    with torch.no_grad():
        for name in dense:
            a, b = (tensors[f"base_model.model.{name}.lora_{x}.weight"] for x in "AB")
            merged.get_submodule(name).weight += 2.0 * b @ a  # lora_alpha 8 / r 4
    want = _greedy(merged)
    assert want != _greedy(_moe_base(folder))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    llm.add_lora(LoRARequest("dense-mlp", 30, tensors=tensors, peft_config=config))
    assert _generate(llm, LoRARequest("dense-mlp", 30)) == want
