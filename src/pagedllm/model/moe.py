"""Mixture-of-experts layers: the fused experts (their parameters, loaders and parallel split),
the sparse MoE block (router, experts, an optional gated shared expert), and the base class
of the MoE families, which maps per-expert checkpoint tensors into the fused parameters.

Expert weights are fused per layer: ``experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's gate
rows, then its up rows) and ``experts.down_proj`` ``[E, H, I]`` — transformers' own layout, so
checkpoints saved that way load whole, and per-expert tensors (``experts.{e}.gate_proj.weight``,
Mixtral's ``w1``/``w3``/``w2``) are stacked in at load. Under tensor parallelism every rank holds
every expert's slice of the intermediate size; with expert parallelism (``enable_expert_parallel``)
each rank holds ``E / tp`` whole experts instead and tokens routed elsewhere contribute zero. Either
way a rank's output is a partial sum: the block all-reduces once (shared expert included).
Quantized experts (``FusedMoE.set_quant_method``): fp8 (``model/quantization/fp8_moe.py``) or int4
(``int4_moe.py``) weights with their scales, run by the same kernels (``ops.moe_scales.ExpertScales``).
"""
from __future__ import annotations

import functools
import re

import torch
from torch import nn

from pagedllm.distributed import (
    expert_parallel_enabled, get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce,
)
from pagedllm.model.layers import (
    Linear, MergedLinear, RowParallelLinear, SiluAndMul, _check_full_rows, _check_quantized_dtype, _divide, _parameter,
    default_weight_loader,
)
from pagedllm.model.llama import DecoderLayer, LlamaForCausalLM
from pagedllm.ops.fused_moe import fused_experts, route


class FusedMoE(nn.Module):
    """The routed experts of one layer; ``forward`` returns this rank's partial sum."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, scoring: str = "softmax", round_weights: bool = False):
        """``round_weights``: the routing weights are rounded to the model dtype before use, as
        transformers' Qwen MoE routers do (Mixtral keeps them in float32)."""
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.renormalize, self.scoring, self.round_weights = renormalize, scoring, round_weights
        self.intermediate_size = intermediate_size  # full, as in the checkpoint
        self.expert_parallel = expert_parallel_enabled()
        if self.expert_parallel:
            self.num_local_experts = _divide(num_experts, self.tp_size, "num_experts (expert parallel)")
            self.first_expert = self.tp_rank * self.num_local_experts
            self.local_intermediate = intermediate_size
            expert_map = torch.full((num_experts,), -1, dtype=torch.long)
            expert_map[self.first_expert:self.first_expert + self.num_local_experts] = torch.arange(
                self.num_local_experts)
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.local_intermediate = _divide(intermediate_size, self.tp_size, "moe intermediate size")
            self.expert_map = None
        local, inter = self.num_local_experts, self.local_intermediate
        self.gate_up_proj = _parameter(local, 2 * inter, hidden_size, weight_loader=self.weight_loader,
                                       full_shape=(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = _parameter(local, hidden_size, inter, weight_loader=self.weight_loader,
                                    full_shape=(num_experts, hidden_size, intermediate_size))
        # enable_return_routed_experts: a [max_tokens, top_k] buffer each forward writes its ids into.
        self.routed_experts_out: torch.Tensor | None = None
        self.act_dtype = torch.get_default_dtype()  # the model dtype (the weights' unless quantized)
        self.quant_method = None  # fp8 experts (model/quantization/fp8_moe.py) or None: dense

    def set_quant_method(self, method) -> None:
        """The loader's, before weights load: the method swaps in its parameters (quantized weights, scales)."""
        self.quant_method = method
        if method is not None:
            method.create_weights(self)

    def expert_scales(self):
        return None if self.quant_method is None else self.quant_method.scales(self)

    def _local_index(self, expert: int) -> int | None:
        index = expert - self.first_expert
        return index if 0 <= index < self.num_local_experts else None

    def _slice_inter(self, tensor: torch.Tensor, dim: int, div: int = 1) -> torch.Tensor:
        """This rank's slice of an expert tensor's intermediate dim (all of it under expert
        parallelism); ``div``: one element covers that many rows (block scales)."""
        if self.expert_parallel or self.tp_size == 1:
            return tensor
        _check_full_rows(tensor, -(-self.intermediate_size // div), dim)
        return tensor.narrow(dim, self.tp_rank * self.local_intermediate // div, self.local_intermediate // div)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """``shard_id`` None: the fused ``[E, ...]`` tensor; ``(expert, 0 | 1)``: one expert's gate
        or up projection ``[I, H]``; ``expert``: one expert's down projection ``[H, I]``."""
        _check_quantized_dtype(param, loaded_weight)
        if shard_id is None:
            self.load_fused(param, loaded_weight, param is self.gate_up_proj, self.weight_loader)
            return
        expert, part = shard_id if isinstance(shard_id, tuple) else (shard_id, None)
        local = self._local_index(expert)
        if local is None:
            return  # another rank's expert
        inter = self.local_intermediate
        if part is None:
            default_weight_loader(param.data[local], self._slice_inter(loaded_weight, 1))
        else:
            default_weight_loader(param.data[local, part * inter:(part + 1) * inter], self._slice_inter(loaded_weight, 0))

    def load_fused(self, param: nn.Parameter, loaded: torch.Tensor, gate_up: bool, load_shard) -> None:
        """A tensor in the fused ``[E, ...]`` layout (all experts; gate rows, then up rows) handed to
        ``load_shard(param, part, shard_id)`` as this rank's experts' shards, as a checkpoint names them."""
        _check_full_rows(loaded, self.num_experts)
        for local in range(self.num_local_experts):
            expert = self.first_expert + local
            if gate_up:
                for part, half in enumerate(loaded[expert].chunk(2, dim=0)):
                    load_shard(param, half, (expert, part))
            else:
                load_shard(param, loaded[expert], expert)

    def kernel_shape(self) -> tuple:
        """What the fused kernels' compiled variants depend on: layers alike share them."""
        return tuple(self.gate_up_proj.shape), tuple(self.down_proj.shape), self.top_k, self.gate_up_proj.dtype, \
            self.expert_map is not None

    def warm_up_kernels(self, max_tokens: int) -> None:
        """Start-up: compile the fused kernels' variants for the tiles of every batch size up to
        ``max_tokens`` (CUDA only)."""
        from pagedllm.ops import triton_ops_for

        if triton_ops_for(self.gate_up_proj) is not None:
            from pagedllm.ops.triton_fused_moe import warm_up

            warm_up(self.gate_up_proj, self.down_proj, self.top_k, self.expert_map, max_tokens, self.act_dtype,
                    self.expert_scales())

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.scoring, self.renormalize,
                             round_to=x.dtype if self.round_weights else None)
        if self.routed_experts_out is not None:
            self.routed_experts_out[:ids.shape[0]].copy_(ids)
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.expert_map, self.expert_scales())


class SharedExpert(nn.Module):
    """A dense SiLU MLP beside the routed experts (Qwen2-MoE), TP-sliced like the Llama MLP;
    ``forward`` returns this rank's partial sum (the MoE block reduces it with the experts')."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.partial(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router (``gate``, replicated), routed experts, and optionally a shared expert scaled by
    ``sigmoid(shared_expert_gate(x))``; one all-reduce for the whole block."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *,
                 renormalize: bool, round_weights: bool, shared_intermediate_size: int | None = None,
                 scoring: str = "softmax"):
        super().__init__()
        self.gate = Linear(hidden_size, num_experts, quantizable=False)  # the router stays dense
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize=renormalize,
                                scoring=scoring, round_weights=round_weights)
        self.shared_expert = None
        if shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1, quantizable=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            # The gate is per token and the same on every rank: it scales each rank's partial sum.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return tensor_model_parallel_all_reduce(out)


# experts.{e}.{projection}.{tensor} in a checkpoint -> (fused parameter, shard part); part None: down.
# fp8 checkpoints' weight_scale (per tensor or channel) / weight_scale_inv (blocks) go to its scales;
# int4 experts' tensors (qweight, scales, weight_packed, ...) to the expert's own linears until stacked
# (under expert parallelism only this rank's experts have them: the others' tensors are skipped).
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(\w+)$")
_FP8_SCALES = ("weight_scale", "weight_scale_inv")


class MoeForCausalLM(LlamaForCausalLM):
    """The decoder with sparse MoE blocks where ``is_moe_layer`` says (the Qwen-MoE config names:
    ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
    ``decoder_sparse_step``, ``mlp_only_layers``); a family overrides the block it builds and how its
    checkpoint names an expert's projections (``expert_projections``)."""

    expert_projections = {"gate_proj": 0, "up_proj": 1, "down_proj": None}

    def __init__(self, config, max_model_len: int | None = None):
        super().__init__(config, max_model_len)
        self.moe_layer_indices = [i for i in range(config.num_hidden_layers) if self.is_moe_layer(config, i)]

    @staticmethod
    def num_experts(config) -> int:
        return config.num_experts

    def is_moe_layer(self, config, layer_idx: int) -> bool:
        return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and self.num_experts(config) > 0
                and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)

    def make_moe_block(self, config) -> nn.Module:
        """Softmax top-k routing, renormalised when ``norm_topk_prob``; routing weights rounded to
        the model dtype as transformers' Qwen routers round them."""
        return SparseMoeBlock(config.hidden_size, self.num_experts(config), config.num_experts_per_tok,
                              config.moe_intermediate_size, renormalize=bool(getattr(config, "norm_topk_prob", False)),
                              round_weights=True)

    def make_layer(self, config, layer_idx: int, rotary: nn.Module) -> nn.Module:
        mlp = self.make_moe_block(config) if self.is_moe_layer(config, layer_idx) else None
        return DecoderLayer(config, layer_idx, rotary, *self.attention_biases(config), qk_norm=self.qk_norm, mlp=mlp)

    def moe_blocks(self) -> list[FusedMoE]:
        """This stage's routed-expert layers, in layer order."""
        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    def stacked_name(self, name: str) -> tuple[str, object]:
        match = _EXPERT_NAME.match(name)
        if match and match.group(3) in self.expert_projections:
            experts, expert, part = match.group(1), int(match.group(2)), self.expert_projections[match.group(3)]
            tensor = match.group(4)
            if self._int4_experts:  # the expert's own linear (gate and up: MergedLinear shards 0, 1)
                if self.get_submodule(experts)._local_index(expert) is None:
                    return None, None  # another rank's expert (expert parallelism)
                linear = "down_proj" if part is None else "gate_up_proj"
                return f"{experts}.int4_experts.{expert}.{linear}.{tensor}", part
            if tensor in ("weight", *_FP8_SCALES):
                suffix = "" if tensor == "weight" else "_scale"
                return (f"{experts}.down_proj{suffix}", expert) if part is None else \
                    (f"{experts}.gate_up_proj{suffix}", (expert, part))
        return super().stacked_name(name)

    @functools.cached_property
    def _int4_experts(self) -> bool:
        """Whether the experts load as per-expert int4 linears (asked once the quantization is attached)."""
        return any(hasattr(block, "int4_experts") for block in self.moe_blocks())

    def shards_needed(self, name: str) -> set:
        if name.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_scale")):
            return {(e, part) for e in range(self.num_experts(self.config)) for part in (0, 1)}
        if name.endswith((".experts.down_proj", ".experts.down_proj_scale")):
            return set(range(self.num_experts(self.config)))
        return super().shards_needed(name)
