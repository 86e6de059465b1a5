"""AWQ checkpoints (``quant_method: "awq"``, GEMM version): ``qweight`` int32 [K, N / 8] and
``qzeros`` [K / G, N / 8] packed along N in AWQ's interleaved order, ``scales`` [K / G, N]."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.quantization.base import QuantizationConfig, fill_const, matches_ignore, quant_param
from pagedllm.model.quantization.int4 import (
    AWQ_ORDER, PACK, Int4LinearMethod, check_group_size, pack_cols, pack_rows, unpack_cols,
)


class AWQLinearMethod(Int4LinearMethod):
    method_name = "awq"

    def create_weights(self, layer: nn.Module) -> None:
        self._check_sizes(layer)
        g = self.group_size
        quant_param(layer, [("in", 1), ("out", PACK)], torch.int32, name="qweight")
        quant_param(layer, [("in", g), ("out", PACK)], torch.int32, name="qzeros")
        # float16 as the format writes them (the model dtype may be bfloat16: a coarser scale)
        quant_param(layer, [("in", g), ("out", 1)], torch.float16, dummy=fill_const(0.004), name="scales")

    def to_canonical(self, layer: nn.Module):
        q = unpack_cols(layer.qweight.data, AWQ_ORDER)  # [K, N]
        zeros = unpack_cols(layer.qzeros.data, AWQ_ORDER)  # [K / G, N]
        return pack_rows(q), layer.scales.data, pack_cols(zeros)


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, zero_point: bool, modules_to_not_convert: list[str] | None):
        self.group_size = check_group_size(group_size, "awq")
        if not zero_point:
            raise ValueError("awq: zero_point false is not supported (AWQ GEMM checkpoints carry zero points)")
        self.ignored = modules_to_not_convert or []

    @classmethod
    def from_config(cls, qc: dict) -> "AWQConfig":
        bits = qc.get("bits", qc.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"awq: {bits}-bit weights are not supported; supported: [4]")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq: version {version!r} is not supported; supported: ['gemm']")
        return cls(int(qc.get("group_size", qc.get("q_group_size", 128))), bool(qc.get("zero_point", True)),
                   qc.get("modules_to_not_convert"))

    experts_supported = True

    def method_for(self, layer, prefix, checkpoint_prefixes):
        if matches_ignore(checkpoint_prefixes, self.ignored, substring=True):
            return None
        return AWQLinearMethod(self.group_size, symmetric=False)
