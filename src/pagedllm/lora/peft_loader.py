"""PEFT LoRA checkpoints → per-module (A, B) pairs, checked against the base model's shapes.

On a mixture-of-experts base only the attention projections and the MLPs of dense layers take
adapters: the routed experts are fused [E, ...] parameters with no per-expert slots, so an
adapter on them (or on a shared expert) is refused by name rather than silently dropped."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.lora.request import LoRARequest

# The projections an adapter may target (fused here: q/k/v, gate/up).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAAdapter:
    lora_int_id: int
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with use_rslora)
    # "model.layers.{i}.self_attn.q_proj" (the base model's HF name) -> (A [r, in], B [out, r])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def expected_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of the base model."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


EXPERT_PARTS = ("experts", "shared_expert", "block_sparse_moe")  # module path parts of MoE experts
MOE_REFUSAL = ("LoRA on MoE experts is not supported (on a mixture-of-experts base an adapter may target the "
               "attention projections q_proj, k_proj, v_proj, o_proj, and the MLPs of dense layers)")


def expert_layers(hf_config: Any) -> set[int]:
    """The decoder layers whose MLP is a sparse MoE block (as MoeForCausalLM.is_moe_layer picks
    them from the config: ``mlp_only_layers``, ``decoder_sparse_step``); empty for dense models."""
    if not (getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)):
        return set()
    dense, step = set(getattr(hf_config, "mlp_only_layers", None) or []), getattr(hf_config, "decoder_sparse_step", 1)
    return {i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % (step or 1) == 0}


def _is_expert(module: str, hf_config: Any) -> bool:
    """An adapted module inside a MoE block: an expert's projection (``mlp.experts.3.gate_proj``,
    Mixtral's ``block_sparse_moe.experts.3.w1``, peft's fused ``mlp.experts``), a shared expert,
    or an MLP projection of a sparse layer (where the base has no dense MLP)."""
    parts = module.split(".")
    if any(p in EXPERT_PARTS for p in parts):
        return True
    if "layers" not in parts[:-1] or not parts[parts.index("layers") + 1].isdigit() or parts[-2] != "mlp":
        return False
    return parts[-1] in TARGETS and int(parts[parts.index("layers") + 1]) in expert_layers(hf_config)


def _read_config(path: str, cfg: dict | None = None) -> dict:
    if cfg is None:
        cfg_path = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"LoRA adapter {path!r} has no adapter_config.json (a PEFT adapter folder is expected)")
        with open(cfg_path) as f:
            cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("target_parameters"):  # peft adapts fused MoE experts' [E, ...] parameters this way
        raise ValueError(f"LoRA adapter {path!r}: target_parameters={cfg['target_parameters']!r} adapts parameters "
                         f"(peft's LoRA on fused MoE experts); {MOE_REFUSAL}")
    for key, allowed in (("use_dora", (False, None)), ("fan_in_fan_out", (False, None)), ("bias", ("none", None)),
                         ("modules_to_save", (None, [])), ("layers_to_transform", (None,)),
                         ("rank_pattern", (None, {})), ("alpha_pattern", (None, {}))):
        if cfg.get(key) not in allowed:
            raise ValueError(f"LoRA adapter {path!r}: {key}={cfg.get(key)!r} is not supported")
    return cfg


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    bin_path = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bin_path):
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors or adapter_model.bin")


def load_adapter(request: LoRARequest, hf_config: Any, max_lora_rank: int) -> LoRAAdapter:
    """Read and check a PEFT adapter: rank within ``max_lora_rank``, known target modules,
    every tensor shaped for the base model. Raises ValueError naming what does not fit."""
    path = request.lora_path or f"<tensors of {request.lora_name}>"
    if request.tensors is None and not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a folder")
    cfg = _read_config(path, request.peft_config)
    rank = int(cfg.get("r", 8))
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {request.lora_name!r} has rank {rank}, more than max_lora_rank="
                         f"{max_lora_rank}; raise max_lora_rank")
    alpha = float(cfg.get("lora_alpha", rank))
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    shapes, layers = expected_shapes(hf_config), hf_config.num_hidden_layers
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    tensors = request.tensors if request.tensors is not None else _read_tensors(path)
    for key, tensor in tensors.items():
        name = key.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name:
                module = name.split(marker)[0]
                pairs.setdefault(module, {})[part] = tensor
                break
        else:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: tensor {key!r} is not a lora_A / lora_B weight "
                             "(embedding and lm_head adapters are not supported)")
    weights = {}
    for module, ab in pairs.items():
        proj, parts = module.rsplit(".", 1)[-1], module.split(".")
        if _is_expert(module, hf_config):
            raise ValueError(f"LoRA adapter {request.lora_name!r} targets {module!r}: {MOE_REFUSAL}")
        if proj not in TARGETS:
            raise ValueError(f"LoRA adapter {request.lora_name!r} targets {module!r}; supported target modules: "
                             f"{list(TARGETS)}")
        if "layers" not in parts[:-1]:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: module {module!r} is not a decoder layer's")
        layer = int(parts[parts.index("layers") + 1])
        if layer >= layers or set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: module {module!r} does not fit the base model")
        a, b = (t.detach().to("cpu", torch.float32) for t in (ab["lora_A"], ab["lora_B"]))
        fan_in, fan_out = shapes[proj]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {module} has A {tuple(a.shape)}, B "
                             f"{tuple(b.shape)}; the base model needs A ({rank}, {fan_in}), B ({fan_out}, {rank})")
        weights["model.layers." + module.split("layers.", 1)[1]] = (a, b)
    if not weights:
        raise ValueError(f"LoRA adapter {request.lora_name!r} holds no LoRA weights")
    return LoRAAdapter(request.lora_int_id, rank, scale, weights)
