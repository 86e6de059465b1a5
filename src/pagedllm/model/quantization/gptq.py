"""GPTQ checkpoints (``quant_method: "gptq"``, 4-bit, ``desc_act`` false): ``qweight`` int32
[K / 8, N] packed along K, ``qzeros`` [K / G, N / 8] packed along N and stored minus one (the
original format, ``checkpoint_format`` "gptq"; "gptq_v2" stores them as they are), ``scales``
[K / G, N], ``g_idx`` [K] (each input's group: with desc_act false simply k // G)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.quantization.base import QuantizationConfig, fill_const, quant_param
from pagedllm.model.quantization.int4 import PACK, Int4LinearMethod, check_group_size, pack_cols, unpack_cols


class GPTQLinearMethod(Int4LinearMethod):
    method_name = "gptq"

    def __init__(self, group_size: int, symmetric: bool, zero_offset: int):
        super().__init__(group_size, symmetric)
        self.zero_offset = zero_offset

    def create_weights(self, layer: nn.Module) -> None:
        self._check_sizes(layer)
        g = self.group_size
        quant_param(layer, [("in", PACK), ("out", 1)], torch.int32, name="qweight")
        # Dummy weights of a symmetric checkpoint: every zero point 8, stored as the format stores it.
        sym_word = (0x77777777 if self.zero_offset else 0x88888888 - 2**32) if self.symmetric else None
        quant_param(layer, [("in", g), ("out", PACK)], torch.int32, name="qzeros",
                    dummy=fill_const(sym_word) if sym_word is not None else None)
        # float16 as the format writes them (the model dtype may be bfloat16: a coarser scale)
        quant_param(layer, [("in", g), ("out", 1)], torch.float16, dummy=fill_const(0.004), name="scales")
        g_idx = quant_param(layer, [("in", 1)], torch.int32, optional=True,
                            dummy=lambda t, gen: t.copy_(torch.arange(t.numel(), device=t.device) // g), name="g_idx")
        g_idx.fill_(-1)  # stays -1 where the checkpoint has none

    def to_canonical(self, layer: nn.Module):
        g_idx = layer.g_idx.data
        if (g_idx >= 0).all():
            first = layer.tp_rank * layer.in_features if layer.shards_input else 0
            expected = (torch.arange(g_idx.numel(), device=g_idx.device) + first) // self.group_size
            if not torch.equal(g_idx.long(), expected):
                raise ValueError("gptq: g_idx reorders the input channels (act-order / desc_act), which is not "
                                 "supported; use a checkpoint quantized with desc_act=false")
        zeros = (unpack_cols(layer.qzeros.data) + self.zero_offset) & 0xF
        if self.symmetric and bool((zeros == 8).all()):
            return layer.qweight.data, layer.scales.data, None
        return layer.qweight.data, layer.scales.data, pack_cols(zeros)


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, group_size: int, symmetric: bool, checkpoint_format: str):
        self.group_size = check_group_size(group_size, "gptq")
        self.symmetric = symmetric
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: checkpoint_format {checkpoint_format!r} is not supported; supported: "
                             "['gptq', 'gptq_v2']")
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0

    @classmethod
    def from_config(cls, qc: dict) -> "GPTQConfig":
        bits = qc.get("bits", 4)
        if bits != 4:
            raise ValueError(f"gptq: {bits}-bit weights are not supported; supported: [4]")
        if qc.get("lm_head", False):
            raise ValueError("gptq: a quantized lm_head (lm_head=true) is not supported; the LM head runs in the "
                             "model dtype")
        if qc.get("desc_act", False):
            raise ValueError("gptq: desc_act=true (act-order, a g_idx permutation) is not supported; "
                             "use a checkpoint quantized with desc_act=false")
        return cls(int(qc.get("group_size", 128)), bool(qc.get("sym", True)),
                   str(qc.get("checkpoint_format", "gptq")))

    experts_supported = True

    def method_for(self, layer, prefix, checkpoint_prefixes):
        return GPTQLinearMethod(self.group_size, self.symmetric, self.zero_offset)
