"""GGUF's 4-bit blocks run quantized (``quantization="gguf"`` on a GGUF model): Q4_0 (``w = (q - 8) d``)
and Q4_1 (``w = q d + m``), blocks of 32 along K with float16 ``d`` (and ``m``), are the shared
W4A16 layout with groups of 32 (Q4_1 with float mins). The loader repacks their blocks
(``blocks_to_canonical``); every other tensor type (Q8_0, the K-quants, F16/F32) and any fused
projection whose parts differ in type is dequantized at load, as without ``quantization``."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.model.quantization.base import QuantizationConfig, fill_const, quant_param
from pagedllm.model.quantization.int4 import PACK, Int4LinearMethod, pack_rows

Q4_0, Q4_1 = 2, 3  # gguf.GGMLQuantizationType
QUANTIZED_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1"}
GROUP = 32
_FUSED = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class GGUFQ4Method(Int4LinearMethod):
    method_name = "gguf"

    def __init__(self, qtype: int):
        super().__init__(GROUP, symmetric=True)
        self.qtype = qtype

    def create_weights(self, layer: nn.Module) -> None:
        self._check_sizes(layer)
        quant_param(layer, [("in", PACK), ("out", 1)], torch.int32, name="qweight")
        quant_param(layer, [("in", GROUP), ("out", 1)], torch.float16, dummy=fill_const(0.004), name="scales")
        if self.qtype == Q4_1:
            quant_param(layer, [("in", GROUP), ("out", 1)], torch.float16, dummy=fill_const(-0.03), name="mins")

    def to_canonical(self, layer: nn.Module):
        return layer.qweight.data, layer.scales.data, None  # Q4_0: zero point 8; Q4_1: its mins stay


def _siblings(prefix: str) -> list[str]:
    parent, leaf = prefix.rsplit(".", 1)
    group = next((g for g in _FUSED if leaf in g), {leaf})
    return [f"{parent}.{name}" for name in sorted(group)]


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, types: dict[str, int]):
        """``types``: HF module name of each projection that runs quantized -> its GGUF type."""
        self.types = types

    @classmethod
    def from_gguf(cls, gguf_file: str | None) -> "GGUFConfig":
        if gguf_file is None:
            raise ValueError("quantization='gguf' needs a GGUF model (a .gguf file)")
        from pagedllm.model.gguf_cache import gguf_tensor_types, gguf_to_hf_name

        types = {}
        for name, qtype in gguf_tensor_types(gguf_file).items():
            hf = gguf_to_hf_name(name) if qtype in QUANTIZED_TYPES else None
            if hf is not None and hf.endswith(".weight") and hf.rsplit(".", 2)[-2] in _PROJECTIONS:
                types[hf[:-len(".weight")]] = qtype
        # A fused projection runs quantized only when its parts share one type.
        return cls({p: t for p, t in types.items() if all(types.get(s) == t for s in _siblings(p))})

    def method_for(self, layer, prefix, checkpoint_prefixes):
        kinds = {self.types.get(p) for p in checkpoint_prefixes}
        return GGUFQ4Method(kinds.pop()) if len(kinds) == 1 and None not in kinds else None


def blocks_to_canonical(raw: np.ndarray, qtype: int) -> dict[str, torch.Tensor]:
    """A Q4_0 / Q4_1 tensor's raw blocks (uint8 [N, K / 32 * block bytes]) -> ``q`` int [N, K]
    (0..15), ``scales`` float16 [N, K / 32] and for Q4_1 ``mins``; block value j < 16 is the low
    nibble of byte j, value j + 16 its high nibble."""
    n = raw.shape[0]
    head = 2 if qtype == Q4_0 else 4
    blocks = torch.from_numpy(np.array(raw)).view(n, -1, head + 16)  # a copy: the file's map is read-only
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
    qs = blocks[..., head:].to(torch.int32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, -1)
    out = {"q": q, "scales": d}
    if qtype == Q4_1:
        out["mins"] = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    return out


def canonical_tensors(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``blocks_to_canonical``'s row-major parts (rows possibly reordered since) -> the checkpoint
    tensors of a GGUFQ4Method layer: ``qweight`` [K / 8, N], ``scales`` / ``mins`` [K / 32, N]."""
    out = {"qweight": pack_rows(parts["q"].t().contiguous()), "scales": parts["scales"].t().contiguous()}
    if "mins" in parts:
        out["mins"] = parts["mins"].t().contiguous()
    return out
