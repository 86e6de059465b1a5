"""FP8 (e4m3) expert weights of a mixture-of-experts layer (``model.moe.FusedMoE``): online
(``quantization="fp8"`` over a 16/32-bit checkpoint: per output channel, at load) or from
checkpoints (``quant_method: "fp8"`` per-tensor ``weight_scale`` or block-wise ``weight_scale_inv``
as Qwen3-30B-A3B-FP8 ships; compressed-tensors fp8 per tensor, channel or block).

The experts' weights stay fp8 in memory beside float32 scales (``ops.moe_scales.ExpertScales``):
per output channel ``[E, 2I]`` / ``[E, H]`` (a per-tensor scale is written into its projection's
rows), or per weight block. The activations stay in the model dtype (W8A16): the Triton kernel
widens each fp8 weight tile in registers and applies the scales in its epilogue (per channel) or
per K tile (blocks); a checkpoint's static expert ``input_scale`` is not used. Decode, where a MoE
layer streams its experts' weights, reads half the bytes; the dense layers keep their W8A8 path.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.quantization.base import _default_dummy, cdiv
from pagedllm.model.quantization.fp8 import FP8_DTYPE, quantize_weight_per_channel
from pagedllm.ops.moe_scales import ExpertScales


class Fp8MoEMethod:
    """fp8 weights for a ``FusedMoE``; ``serialized`` False: quantized at load (per channel);
    ``block`` (bn, bk): block-wise checkpoint scales."""

    def __init__(self, serialized: bool, block: tuple[int, int] | None = None):
        self.serialized, self.block = serialized, (int(block[0]), int(block[1])) if block else None

    def create_weights(self, moe: nn.Module) -> None:
        experts, inter, hidden = moe.num_local_experts, moe.local_intermediate, moe.hidden_size
        if self.block is not None:
            block_n, block_k = self.block
            if block_k % 16:
                raise ValueError(f"block-wise fp8 experts: block size {block_k} along K is not a multiple of 16")
            sliced = moe.tp_size > 1 and not moe.expert_parallel
            if inter % block_n or (sliced and inter % block_k):
                raise ValueError(f"block-wise fp8 experts: the intermediate size per rank ({inter}) is not a multiple "
                                 f"of the block size {self.block}")
        if not self.serialized:
            return  # the 16/32-bit experts load as they are and are quantized in process_after_loading
        for name in ("gate_up_proj", "down_proj"):
            dense = getattr(moe, name)
            param = nn.Parameter(torch.empty(dense.shape, dtype=FP8_DTYPE), requires_grad=False)
            param.weight_loader, param.full_shape, param.exact_dtype = moe.weight_loader, dense.full_shape, True
            param.dummy_fill = _default_dummy  # fp8 values of scale ~1 (dummy weights: the benchmarks)
            setattr(moe, name, param)
        full_inter = moe.intermediate_size
        if self.block is None:
            shapes = {"gate_up_proj_scale": ((experts, 2 * inter), (moe.num_experts, 2 * full_inter)),
                      "down_proj_scale": ((experts, hidden), (moe.num_experts, hidden))}
        else:
            block_n, block_k = self.block
            shapes = {"gate_up_proj_scale": ((experts, 2 * inter // block_n, cdiv(hidden, block_k)),
                                             (moe.num_experts, 2 * full_inter // block_n, cdiv(hidden, block_k))),
                      "down_proj_scale": ((experts, cdiv(hidden, block_n), cdiv(inter, block_k)),
                                          (moe.num_experts, cdiv(hidden, block_n), cdiv(full_inter, block_k)))}
        for name, (shape, full_shape) in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
            param.weight_loader = lambda p, t, shard_id=None: self.load_scale(moe, p, t, shard_id)
            param.full_shape, param.dummy_fill = full_shape, lambda t, g: t.fill_(0.02)
            moe.register_parameter(name, param)

    def load_scale(self, moe: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """A checkpoint's expert scale: ``shard_id`` (expert, 0 | 1) one expert's gate or up
        projection, ``expert`` its down projection, None all experts in our fused layout (dummy
        weights). Per-tensor scales fill their projection's rows; per-channel ones ([N] or
        [N, 1]) and block ones are sliced to this rank's intermediate rows (in blocks)."""
        if shard_id is None:
            moe.load_fused(param, loaded, param is moe.gate_up_proj_scale,
                           lambda p, t, shard: self.load_scale(moe, p, t, shard))
            return
        expert, part = shard_id if isinstance(shard_id, tuple) else (shard_id, None)
        local = moe._local_index(expert)
        if local is None:
            return  # another rank's expert
        div_n, div_k = self.block or (1, 1)
        rows = moe.local_intermediate // div_n
        dest = param.data[local] if part is None else param.data[local, part * rows:(part + 1) * rows]
        if loaded.numel() == 1:  # per tensor
            dest.fill_(float(loaded.reshape(())))
            return
        if part is None:  # down: rows over the hidden size, the intermediate size along K
            sliced = loaded if self.block is None else moe._slice_inter(loaded, 1, div_k)
        else:
            sliced = moe._slice_inter(loaded, 0, div_n)
        if self.block is None:
            sliced = sliced.reshape(-1)
        if tuple(sliced.shape) != tuple(dest.shape):
            raise ValueError(f"expert scale has shape {tuple(loaded.shape)}, which does not fit "
                             f"{tuple(dest.shape)} on this rank")
        dest.copy_(sliced)

    def process_after_loading(self, moe: nn.Module) -> None:
        if self.serialized:
            return
        for name in ("gate_up_proj", "down_proj"):  # one expert at a time: no float32 copy of the layer
            dense = getattr(moe, name).data
            q = torch.empty(dense.shape, dtype=FP8_DTYPE, device=dense.device)
            scale = torch.empty(dense.shape[:2], dtype=torch.float32, device=dense.device)
            for e in range(dense.shape[0]):
                q[e], scale[e] = quantize_weight_per_channel(dense[e])
            setattr(moe, name, nn.Parameter(q, requires_grad=False))
            moe.register_parameter(f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def scales(self, moe: nn.Module) -> ExpertScales:
        return ExpertScales(moe.gate_up_proj_scale, moe.down_proj_scale, block=self.block)
