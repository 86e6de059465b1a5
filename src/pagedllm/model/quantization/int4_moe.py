"""int4 (W4A16) expert weights of a mixture-of-experts layer (``model.moe.FusedMoE``) from AWQ,
GPTQ and compressed-tensors ``pack-quantized`` checkpoints (Qwen3-30B-A3B-GPTQ-Int4 and its AWQ
twins ship one set of tensors per expert and projection).

Each local expert's gate/up and down are first built as the format's own linears
(``MergedLinear`` / ``RowParallelLinear`` with the format's ``Int4LinearMethod``), so an expert's
checkpoint tensors load, unpack and split over tensor-parallel ranks exactly as a dense layer's
do. Once loaded, each is turned into the canonical layout (``model/quantization/int4.py``) and the
experts are stacked: words [E, K / 8, N], scales [E, N, K / G] (per output row, in the
checkpoint's dtype) and zero points unpacked [E, N, K / G] uint8 (none when symmetric), which the
fused-MoE kernels read (``ops.moe_scales.ExpertScales``). The per-expert linears are then dropped.

Under tensor parallelism the per-expert linears are the usual column/row-parallel ones (every
expert's slice of the intermediate size on each rank). With expert parallelism a rank holds its
``E / tp`` experts whole: their linears are built unsliced (nothing is narrowed at load), keyed by
the global expert index as the checkpoint names them (``int4_experts.{e}``; ``MoeForCausalLM``
skips the other ranks' experts), and the stacked tensors keep the full intermediate size.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.model.quantization.int4 import Int4LinearMethod
from pagedllm.ops.moe_scales import ExpertScales
from pagedllm.ops.int4_layout import unpack_cols

PROJECTIONS = ("gate_up_proj", "down_proj")


class Int4MoEMethod:
    """int4 experts; ``make_method`` gives the format's method for one expert projection."""

    def __init__(self, make_method: Callable[[], Int4LinearMethod]):
        self.make_method = make_method
        sample = make_method()
        self.group_size, self.method_name = sample.group_size, sample.method_name

    def create_weights(self, moe: nn.Module) -> None:
        del moe.gate_up_proj, moe.down_proj  # stacked from the per-expert linears after loading
        experts = nn.ModuleDict()  # keyed by the global expert index (this rank's experts under expert parallelism)
        for local in range(moe.num_local_experts):
            gate_up, down = _expert_linears(moe.hidden_size, moe.intermediate_size, moe.expert_parallel)
            gate_up.set_quant_method(self.make_method())
            down.set_quant_method(self.make_method())
            experts[str(moe.first_expert + local)] = nn.ModuleDict({"gate_up_proj": gate_up, "down_proj": down})
        moe.int4_experts = experts

    def process_after_loading(self, moe: nn.Module) -> None:
        """Runs after each per-expert linear's own (the loader visits children first)."""
        experts = list(moe.int4_experts.values())  # in local order
        for name in PROJECTIONS:
            layers = [expert[name] for expert in experts]
            words = torch.stack([layer.qweight.data for layer in layers])  # [E, K / 8, N]
            scales = torch.stack([layer.scales.data.t() for layer in layers]).contiguous()  # [E, N, K / G]
            zeros = None
            if layers[0].qzeros is not None:  # canonical [K / G, N / 8] packed along N
                zeros = torch.stack([unpack_cols(layer.qzeros.data)[:, :words.shape[2]].t() for layer in layers])
                zeros = nn.Parameter(zeros.to(torch.uint8).contiguous(), requires_grad=False)
            setattr(moe, name, nn.Parameter(words, requires_grad=False))
            moe.register_parameter(f"{name}_scale", nn.Parameter(scales, requires_grad=False))
            moe.register_parameter(f"{name}_zeros", zeros)
        del moe.int4_experts

    def scales(self, moe: nn.Module) -> ExpertScales:
        return ExpertScales(moe.gate_up_proj_scale, moe.down_proj_scale, group=self.group_size,
                            w13_zeros=moe.gate_up_proj_zeros, w2_zeros=moe.down_proj_zeros)


def _expert_linears(hidden: int, inter: int, whole: bool) -> tuple[nn.Module, nn.Module]:
    """One expert's gate/up and down linears: tensor-parallel slices of the intermediate size, or
    (``whole``: expert parallelism) the whole expert, loaded as the checkpoint holds it."""
    from pagedllm.model.layers import Linear, MergedLinear, RowParallelLinear

    if not whole:
        return MergedLinear(hidden, [inter, inter]), RowParallelLinear(inter, hidden)
    return MergedLinear(hidden, [inter, inter], replicated=True), Linear(inter, hidden)
