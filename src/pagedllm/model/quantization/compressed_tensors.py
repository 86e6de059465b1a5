"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, as llm-compressor
writes them): ``pack-quantized`` int4 weights (W4A16, symmetric or with zero points, groups of
32/64/128) and ``float-quantized`` / ``naive-quantized`` fp8 weights (per tensor, channel or
block; activations dynamic per token, static per tensor, or none)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.quantization.base import QuantizationConfig, fill_const, matches_ignore, quant_param
from pagedllm.model.quantization.fp8 import Fp8BlockLinearMethod, Fp8LinearMethod
from pagedllm.model.quantization.int4 import (
    PACK, Int4LinearMethod, check_group_size, pack_cols, pack_rows, unpack_cols, unpack_rows,
)

_INT4_FORMATS = ("pack-quantized",)
_FP8_FORMATS = ("float-quantized", "naive-quantized")


class CompressedTensorsW4A16(Int4LinearMethod):
    """``weight_packed`` int32 [N, K / 8] (values offset by +8, packed along K),
    ``weight_scale`` [N, K / G], and with zero points ``weight_zero_point`` int32 [N / 8, K / G]
    (offset by +8, packed along N)."""

    method_name = "compressed-tensors"

    def create_weights(self, layer: nn.Module) -> None:
        self._check_sizes(layer)
        g = self.group_size
        quant_param(layer, [("out", 1), ("in", PACK)], torch.int32, name="weight_packed")
        quant_param(layer, [("out", 1), ("in", g)], torch.get_default_dtype(), dummy=fill_const(0.004),
                    name="weight_scale")
        if not self.symmetric:
            quant_param(layer, [("out", PACK), ("in", g)], torch.int32, name="weight_zero_point")

    def to_canonical(self, layer: nn.Module):
        q = unpack_cols(layer.weight_packed.data)  # [N, K], 0..15 (the int4 value + 8)
        zeros = None
        if not self.symmetric:
            zeros = pack_cols(unpack_rows(layer.weight_zero_point.data).t().contiguous())  # [K / G, N / 8]
        return pack_rows(q.t().contiguous()), layer.weight_scale.data.t(), zeros


def _targets_match(targets: list[str], prefixes: list[str]) -> bool:
    if "Linear" in targets:
        return True
    return matches_ignore(prefixes, [t for t in targets if t != "Linear"])


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], dict, dict | None, str]], ignore: list[str]):
        self.groups, self.ignore = groups, ignore

    @classmethod
    def from_config(cls, qc: dict) -> "CompressedTensorsConfig":
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors: quantization_status {status!r} is not supported; supported: "
                             "['compressed'] (a checkpoint saved in its quantized form)")
        sparsity = qc.get("sparsity_config") or {}
        if sparsity.get("format") not in (None, "dense"):
            raise ValueError(f"compressed-tensors: sparse checkpoints (sparsity_config format "
                             f"{sparsity.get('format')!r}) are not supported")
        top_format = qc.get("format")
        groups = []
        for name, group in (qc.get("config_groups") or {}).items():
            weights = group.get("weights")
            if not weights:
                raise ValueError(f"compressed-tensors: config group {name!r} has no weights scheme")
            fmt = group.get("format") or top_format
            groups.append((list(group.get("targets") or []), weights, group.get("input_activations"), fmt))
            cls._method(weights, group.get("input_activations"), fmt)  # refuse what we do not run, now
        if not groups:
            raise ValueError("compressed-tensors: quantization_config has no config_groups")
        return cls(groups, list(qc.get("ignore") or []))

    @staticmethod
    def _method(weights: dict, acts: dict | None, fmt: str | None):
        bits, wtype, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")
        if wtype == "int" and bits == 4:
            if fmt not in _INT4_FORMATS:
                raise ValueError(f"compressed-tensors: int4 weights in format {fmt!r} are not supported; supported: "
                                 f"{list(_INT4_FORMATS)}")
            if strategy != "group":
                raise ValueError(f"compressed-tensors: int4 weight strategy {strategy!r} is not supported; "
                                 "supported: ['group']")
            if acts is not None:
                raise ValueError("compressed-tensors: int4 weights with quantized activations (W4A8) are not "
                                 "supported; supported: W4A16")
            group_size = check_group_size(int(weights.get("group_size") or 0), "compressed-tensors")
            return CompressedTensorsW4A16(group_size, symmetric=bool(weights.get("symmetric", True)))
        if wtype == "float" and bits == 8:
            if fmt not in _FP8_FORMATS:
                raise ValueError(f"compressed-tensors: fp8 weights in format {fmt!r} are not supported; supported: "
                                 f"{list(_FP8_FORMATS)}")
            act_scheme = None
            if acts is not None:
                if acts.get("type", "float") != "float" or acts.get("num_bits") != 8:
                    raise ValueError(f"compressed-tensors: activations {acts} are not supported with fp8 weights")
                if acts.get("dynamic"):
                    if acts.get("strategy") not in ("token", "tensor"):
                        raise ValueError(f"compressed-tensors: dynamic activation strategy {acts.get('strategy')!r} "
                                         "is not supported; supported: ['token']")
                    act_scheme = "dynamic"
                elif acts.get("strategy") == "tensor":
                    act_scheme = "static"
                else:
                    raise ValueError(f"compressed-tensors: static activation strategy {acts.get('strategy')!r} is "
                                     "not supported; supported: ['tensor']")
            if strategy == "block":
                block = weights.get("block_structure") or [128, 128]
                if act_scheme == "static":
                    raise ValueError("compressed-tensors: block-wise fp8 weights need dynamic activations")
                return Fp8BlockLinearMethod(tuple(block), scale_name="weight_scale")
            if strategy not in ("tensor", "channel"):
                raise ValueError(f"compressed-tensors: fp8 weight strategy {strategy!r} is not supported; "
                                 "supported: ['tensor', 'channel', 'block']")
            return Fp8LinearMethod(serialized=True, act_scheme=act_scheme, weight_strategy=strategy)
        raise ValueError(f"compressed-tensors: {bits}-bit {wtype} weights are not supported; supported: "
                         "4-bit int (pack-quantized), 8-bit float (float-quantized)")

    experts_supported = True  # fp8 (fp8_moe.py) and int4 (int4_moe.py)

    def method_for(self, layer, prefix, checkpoint_prefixes):
        if matches_ignore(checkpoint_prefixes, self.ignore):
            return None
        for targets, weights, acts, fmt in self.groups:
            if _targets_match(targets, checkpoint_prefixes):
                return self._method(weights, acts, fmt)
        return None

