"""What a quantization method gives a linear layer: its parameters (with loaders and TP axes),
how to run it (``apply``), and what to do once the checkpoint is in (``process_after_loading``)."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

# The config the linears being built read (set by the loader around the model's construction).
_CURRENT: list = [None]


@contextmanager
def quant_config_context(config: "QuantizationConfig | None") -> Iterator[None]:
    previous, _CURRENT[0] = _CURRENT[0], config
    try:
        yield
    finally:
        _CURRENT[0] = previous


def current_quant_config() -> "QuantizationConfig | None":
    return _CURRENT[0]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Checkpoint tensors that belong to the quantization but to no linear's parameters: the
# compressed-tensors shape record, and KV-cache/attention scales (FP8 KV cache, another path).
_SKIPPED_SUFFIXES = (".weight_shape", ".k_scale", ".v_scale", ".q_scale", ".prob_scale", ".kv_scale",
                     ".output_scale")


class QuantizationConfig:
    """A checkpoint's (or the user's) quantization: hands each linear layer its method."""

    name: str = ""

    def method_for(self, layer: nn.Module, prefix: str, checkpoint_prefixes: list[str]) -> "QuantizationMethod | None":
        """The method of the linear ``prefix`` (our module name; ``checkpoint_prefixes``: the
        checkpoint's names of the projections it fuses); None: it stays dense."""
        raise NotImplementedError

    experts_supported = False  # whether a mixture of experts' routed experts run quantized (experts.py)

    def skips_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor is not a parameter of ours (read elsewhere or not at all;
        quantized MoE experts run with 16-bit activations: their static input scales go unused)."""
        return name.endswith(_SKIPPED_SUFFIXES) or (".experts." in name and name.endswith(".input_scale"))


def experts_unsupported(method: str, model_name: str) -> ValueError:
    return ValueError(f"quantization {method!r} is not supported for the experts of mixture-of-experts models "
                      f"({model_name}); supported there: fp8 (online and checkpoints), awq, gptq, compressed-tensors")


class QuantizationMethod:
    """The weights and the matmul of one quantized linear layer."""

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def process_after_loading(self, layer: nn.Module) -> None:
        """Turn the checkpoint's layout into the one ``apply`` runs on (still quantized)."""


class UnquantizedMethod(QuantizationMethod):
    """A dense weight, exactly as a linear built without quantization holds it."""

    def create_weights(self, layer: nn.Module) -> None:
        layer.weight = layer._dense_weight()


def quant_param(layer: nn.Module, axes: list, dtype: torch.dtype, *, per_shard: bool = False,
                optional: bool = False, dummy: Callable[[torch.Tensor, torch.Generator], None] | None = None,
                name: str | None = None) -> nn.Parameter:
    """A parameter of ``layer`` laid out by ``axes``: ``("out", div)`` / ``("in", div)`` a dim over
    the output / input features where one element covers ``div`` of them (8: packed int4; the
    group or block size: scales), an int a fixed size. ``per_shard``: one value per fused
    projection (per-tensor scales). Registered on ``layer`` when ``name`` is given."""
    shape, full, dims = [], [], {}
    if per_shard:
        shape = full = [len(layer.output_sizes)]
    for dim, axis in enumerate([] if per_shard else axes):
        if isinstance(axis, int):
            shape.append(axis)
            full.append(axis)
            continue
        kind, div = axis
        local_size, full_size = ((layer.out_features, sum(layer.output_sizes)) if kind == "out"
                                 else (layer.in_features, layer.input_size))
        shape.append(cdiv(local_size, div))
        full.append(cdiv(full_size, div))
        dims[kind] = (dim, div)
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = layer.weight_loader
    param.full_shape = tuple(full)
    if "out" in dims:
        param.output_dim, param.output_div = dims["out"]
    if "in" in dims:
        param.input_dim, param.input_div = dims["in"]
    # Packed ints and fp8 values load only as themselves: a cast would silently store garbage
    # (a 16-bit tensor where the checkpoint should hold its quantized form).
    param.exact_dtype = dtype == torch.int32 or dtype.itemsize == 1
    param.per_shard = per_shard
    param.optional = optional  # a checkpoint may leave it out
    param.dummy_fill = dummy or _default_dummy
    if name is not None:
        layer.register_parameter(name, param)
    return param


def _default_dummy(t: torch.Tensor, g: torch.Generator) -> None:
    if t.dtype == torch.int32:  # packed 4-bit fields: every bit random
        t.random_(-2**31, 2**31 - 1, generator=g)
    elif t.dtype.itemsize == 1:  # float8: weights of scale ~0.02 after their scale
        t.copy_(torch.empty(t.shape, device=t.device).normal_(0.0, 1.0, generator=g).clamp(-4, 4))
    else:
        t.normal_(0.0, 0.02, generator=g)


def fill_const(value: float) -> Callable[[torch.Tensor, torch.Generator], None]:
    return lambda t, g: t.fill_(value)


def checkpoint_prefixes(name: str, stacked_params: dict) -> list[str]:
    """The checkpoint's module names of the projections our linear ``name`` fuses (q/k/v, gate/up)."""
    dotted = name + "."
    found = [dotted.replace(fused, part)[:-1] for part, (fused, _) in stacked_params.items() if fused in dotted]
    return found or [name]


def matches_ignore(prefixes: list[str], ignore: list[str], *, substring: bool = False) -> bool:
    """Whether the layer is exempt from quantization: all of its projections match ``ignore``
    (exact names or ``re:`` regexes; ``substring``: AWQ's modules_to_not_convert), or none."""
    def hit(prefix: str) -> bool:
        for entry in ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], prefix) or re.match(entry[3:], prefix):
                    return True
            elif prefix == entry or prefix.endswith("." + entry) or (substring and entry in prefix):
                return True
        return False

    hits = [hit(p) for p in prefixes]
    if any(hits) and not all(hits):
        raise ValueError(f"the quantization config exempts only some of the projections fused in one layer "
                         f"({prefixes}); they must be quantized alike")
    return bool(hits) and all(hits)
