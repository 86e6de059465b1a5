"""Building blocks of decoder models: norms, rotary embedding, activations, linears.

Every parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` so that
loading a checkpoint is a loop over its tensors, and a ``full_shape`` (its shape with one
rank). Under tensor parallelism (Megatron-style, ``pagedllm.distributed``) the loaders take
the full HF checkpoint tensor and keep this rank's slice: fused q/k/v and gate/up split
their output rows (column-parallel), ``o_proj``/``down_proj`` their input columns
(row-parallel, one all-reduce after), the embedding and LM head their vocab rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import (
    get_tp_rank, get_tp_size, tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce,
)
from pagedllm.lora.layers import MAPPING as LORA_MAPPING
from pagedllm.model.quantization.base import UnquantizedMethod, current_quant_config
from pagedllm.model.activations import GeluTanhAndMul, SiluAndMul  # noqa: F401  (re-exported)
from pagedllm.model.rotary import RotaryEmbedding, rope_params  # noqa: F401  (re-exported)
from pagedllm.ops import triton_ops_for
from pagedllm.ops.cpu_linear import cpu_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, lora=None) -> torch.Tensor:
    """``F.linear``; on CUDA the Triton ops' version (small decode batches on the small-row
    kernels), on CPU oneDNN's (pagedllm.ops.cpu_linear: MKL sgemm is several times slower).
    ``lora``: a LoRA delta whose shrink ran (Triton ops only: ``LoRASlots.shrink``)."""
    ops = None if x.device.type == "cpu" else triton_ops_for(x)
    if ops is not None:
        return ops.linear(x, weight, bias, lora=lora)
    if lora is not None:
        raise ValueError("a fused LoRA delta needs the Triton ops")
    return cpu_linear(x, weight, bias) if x.device.type == "cpu" else F.linear(x, weight, bias)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape and param.numel() == loaded_weight.numel() == 1:
        loaded_weight = loaded_weight.reshape(param.shape)  # a scalar saved as [] or [1]
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, parameter expects {tuple(param.shape)}")
    param.data.copy_(loaded_weight)  # copy_ also casts to the model's dtype and device


def _check_quantized_dtype(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if getattr(param, "exact_dtype", False) and loaded_weight.dtype != param.dtype:
        raise ValueError(f"checkpoint tensor is {str(loaded_weight.dtype).removeprefix('torch.')}, the quantized "
                         f"parameter holds {str(param.dtype).removeprefix('torch.')} (is the checkpoint in its "
                         "quantized form?)")


def load_tensor(param: nn.Parameter, tensor: torch.Tensor, shard_id=None, what: str = "") -> None:
    """``param``'s weight_loader (a plain copy where it has none) takes a checkpoint tensor (a
    fused parameter's part: ``shard_id``); a loader's ValueError names ``what``."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        loader(*(param, tensor) if shard_id is None else (param, tensor, shard_id))
    except ValueError as e:
        raise ValueError(f"loading {what} (shard {shard_id}): {e}") from None


def _parameter(*shape: int, weight_loader=default_weight_loader, full_shape: tuple | None = None) -> nn.Parameter:
    # Allocated in the default dtype/device, which the loader sets, so nothing is built twice.
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = weight_loader
    param.full_shape = tuple(full_shape or shape)  # the checkpoint tensor's shape (all ranks together)
    return param


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def _check_full_rows(loaded_weight: torch.Tensor, rows: int, dim: int = 0) -> None:
    if loaded_weight.shape[dim] != rows:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {rows} along dim {dim} "
                         "(the full tensor: each tensor-parallel rank keeps its slice)")


class RMSNorm(nn.Module):
    """RMSNorm as HF Llama computes it; with ``residual`` it first adds it (fused pre-norm).
    On CUDA one Triton kernel does either (pagedllm.ops); the torch code is the reference."""

    dummy_value = 1.0  # what dummy weights fill the weight with
    # Set by the loader where the projection after this norm is fp8 W8A8 with per-token activations:
    # the Triton kernel then also quantizes its output rows, and that projection skips its own launch.
    fp8_out = False

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = _parameter(hidden_size)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One op for the six below (the same float32 values: tests/model/test_cpu_fast_paths.py).
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ops = triton_ops_for(x)
        if ops is not None and (residual is None or residual.dtype == x.dtype):
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps, self.fp8_out)
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.fp8_out)
        if residual is None:
            return self._norm(x)
        x = x + residual  # in the model dtype, like HF's `residual + hidden_states`
        return self._norm(x), x


class Fp32RMSNorm(RMSNorm):
    """RMSNorm with the weight applied in float32 and one rounding at the end (Olmo 2; Gemma with
    ``offset`` 1: ``x * (1 + w)``), where Llama rounds before the weight: the torch code is its
    only path."""

    offset = 0.0

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (self.offset + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(Fp32RMSNorm):
    offset = 1.0
    dummy_value = 0.0  # a zero weight is the identity scale


class ShardedRMSNorm(Fp32RMSNorm):
    """Olmo 2's q/k norm over a whole column-parallel projection: each rank holds a slice of the
    features (and of the weight); the mean square is all-reduced. With KV heads replicated on
    ranks every feature appears equally often, so the mean over all ranks' slices is still the
    mean over the full projection."""

    def __init__(self, local_size: int, full_size: int, eps: float, shard_start: int):
        super().__init__(local_size, eps)
        self.tp_size, self.shard_start = get_tp_size(), shard_start
        self.weight = _parameter(local_size, weight_loader=self.weight_loader, full_shape=(full_size,))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_size > 1:
            _check_full_rows(loaded_weight, param.full_shape[0])
            loaded_weight = loaded_weight.narrow(0, self.shard_start, param.shape[0])
        default_weight_loader(param, loaded_weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super()._norm(x)
        h = x.float()
        mean_sq = tensor_model_parallel_all_reduce(h.pow(2).mean(-1, keepdim=True)) / self.tp_size
        return (h * torch.rsqrt(mean_sq + self.eps) * self.weight.float()).to(x.dtype)


class Linear(nn.Module):
    """``y = x W^T + b`` with loaders, replicated on every rank. With LoRA enabled the runner
    attaches ``lora`` (pagedllm.lora.layers.LoRASlots): each token's adapter delta is added.

    Quantization (pagedllm.model.quantization): built while a quantization config is current,
    a ``quantizable`` linear leaves ``weight`` unset and the loader hands it a ``quant_method``
    (by its name, which the checkpoint's ignore lists may exempt), whose ``create_weights``
    registers the method's parameters (packed ints, fp8, scales, zeros). Every parameter says
    which of its dims are the output (``output_dim``) and input (``input_dim``) features and how
    many features one of its elements covers there (``output_div``/``input_div``: 8 for packed
    int4, the group size for scales), so the loaders below slice any of them for tensor
    parallelism; ``per_shard`` parameters (per-tensor scales of fused projections) hold one
    value per shard."""

    lora = None
    quant_method = None
    tp_size, tp_rank = 1, 0
    shards_input = False  # row-parallel: each rank holds a slice of the input features

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quantizable: bool = True):
        super().__init__()
        self._set_sizes(input_size, input_size, [output_size], [output_size])
        self._create_weights(bias, quantizable)

    def _set_sizes(self, input_size: int, input_size_per_rank: int, output_sizes: list[int],
                   sizes_per_rank: list[int]) -> None:
        self.input_size, self.input_size_per_rank = input_size, input_size_per_rank
        self.output_sizes, self.sizes_per_rank = list(output_sizes), list(sizes_per_rank)

    @property
    def in_features(self) -> int:
        """Input features of this rank's slice."""
        return self.input_size_per_rank

    @property
    def out_features(self) -> int:
        """Output features of this rank's slice."""
        return sum(self.sizes_per_rank)

    def _create_weights(self, bias: bool, quantizable: bool) -> None:
        if quantizable and current_quant_config() is not None:
            self.register_parameter("weight", None)  # the loader creates it with the layer's quant method
        else:
            self.weight = self._dense_weight()
        self.bias = None
        if bias:
            self.bias = _parameter(self.out_features, weight_loader=self.weight_loader,
                                   full_shape=(sum(self.output_sizes),))
            self.bias.output_dim = 0

    def _dense_weight(self) -> nn.Parameter:
        weight = _parameter(self.out_features, self.input_size_per_rank, weight_loader=self.weight_loader,
                            full_shape=(sum(self.output_sizes), self.input_size))
        weight.output_dim, weight.input_dim = 0, 1
        return weight

    def set_quant_method(self, method) -> None:
        """Create this layer's weights with ``method`` (a QuantizationMethod; None: dense)."""
        method = method or UnquantizedMethod()
        method.create_weights(self)
        self.quant_method = None if isinstance(method, UnquantizedMethod) else method

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        _check_quantized_dtype(param, loaded_weight)
        default_weight_loader(param, loaded_weight)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is None:
            return linear(x, self.weight, bias)
        return self.quant_method.apply(self, x, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None or not LORA_MAPPING.groups:
            return self._matmul(x, self.bias)
        if self.quant_method is None:  # the adapters' expand rides in the GEMM where it can
            delta = self.lora.shrink(x)
            if delta is not None:
                return linear(x, self.weight, self.bias, lora=delta)
        return self.lora.apply(x, self._matmul(x, self.bias))


def _narrow_features(tensor: torch.Tensor, dim: int, start: int, size: int, div: int, what: str) -> torch.Tensor:
    """Features [start, start + size) of ``tensor`` along ``dim``, where one element covers
    ``div`` features (packed int4: 8; group scales: the group size)."""
    if start % div or size % div:
        raise ValueError(f"{what}: features [{start}, {start + size}) do not align with the quantization's "
                         f"{div}-feature packs/groups (tensor parallel or fused-projection split)")
    return tensor.narrow(dim, start // div, size // div)


class RowParallelLinear(Linear):
    """``o_proj`` / ``down_proj``: each rank holds a slice of the input columns and computes a
    partial sum; one all-reduce adds them up, then the (replicated) bias is added once."""

    shards_input = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quantizable: bool = True):
        nn.Module.__init__(self)
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        per_rank = _divide(input_size, self.tp_size, "input size of a row-parallel linear")
        self._set_sizes(input_size, per_rank, [output_size], [output_size])
        self._create_weights(bias, quantizable)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        _check_quantized_dtype(param, loaded_weight)
        dim = getattr(param, "input_dim", None)
        if self.tp_size > 1 and dim is not None:
            div = getattr(param, "input_div", 1)
            _check_full_rows(loaded_weight, param.full_shape[dim], dim=dim)
            loaded_weight = _narrow_features(loaded_weight, dim, self.tp_rank * self.input_size_per_rank,
                                             self.input_size_per_rank, div, "row-parallel linear")
        default_weight_loader(param, loaded_weight)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, before the all-reduce and the bias."""
        return self._matmul(x, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return Linear.forward(self, x)
        y = self.partial(x)
        if self.lora is not None and LORA_MAPPING.groups:  # this rank's part of the delta, summed below
            y = self.lora.apply(x, y)
        y = tensor_model_parallel_all_reduce(y)
        return y if self.bias is None else y + self.bias


class MergedLinear(Linear):
    """Several projections of one input stacked on the output dim (gate/up: shard ids 0, 1),
    column-parallel: each rank holds its slice of every projection's rows, stacked
    (``replicated``: every row on every rank, as an expert held whole under expert parallelism)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 sizes_per_rank: list[int] | None = None, quantizable: bool = True, replicated: bool = False):
        nn.Module.__init__(self)
        self.tp_size, self.tp_rank = (1, 0) if replicated else (get_tp_size(), get_tp_rank())
        sizes_per_rank = sizes_per_rank or [
            _divide(size, self.tp_size, "output size of a column-parallel linear") for size in output_sizes]
        self._set_sizes(input_size, input_size, output_sizes, sizes_per_rank)
        self._create_weights(bias, quantizable)

    def _shard_ids(self) -> list:
        return list(range(len(self.output_sizes)))

    def _shard_index(self, shard_id) -> int:
        return shard_id

    def _shard_range(self, shard_id) -> tuple[int, int]:
        i = self._shard_index(shard_id)
        return sum(self.sizes_per_rank[:i]), self.sizes_per_rank[i]

    def _shard_start(self, index: int) -> int:
        """First row of this rank's slice within the full projection ``index``."""
        return self.tp_rank * self.sizes_per_rank[index]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        _check_quantized_dtype(param, loaded_weight)
        if getattr(param, "per_shard", False):  # one value per projection (a per-tensor scale)
            index = None if shard_id is None else self._shard_index(shard_id)
            if loaded_weight.numel() != 1:
                raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected one value "
                                 "(a per-tensor scale)")
            target = param.data if index is None else param.data[index]
            target.fill_(loaded_weight.reshape(()).item())
            return
        dim = getattr(param, "output_dim", None)
        if dim is None:  # not split by output features
            return default_weight_loader(param, loaded_weight)
        div = getattr(param, "output_div", 1)
        if shard_id is None:  # an already fused checkpoint tensor
            if self.tp_size == 1:
                return default_weight_loader(param, loaded_weight)
            _check_full_rows(loaded_weight, param.full_shape[dim], dim)
            sizes = [size // div for size in self.output_sizes]
            if any(size % div for size in self.output_sizes):
                raise ValueError(f"fused projections of sizes {self.output_sizes} do not align with the "
                                 f"quantization's {div}-feature packs/groups")
            for sid, part in zip(self._shard_ids(), loaded_weight.split(sizes, dim=dim)):
                self.weight_loader(param, part, sid)
            return
        offset, size = self._shard_range(shard_id)
        index = self._shard_index(shard_id)
        if self.tp_size > 1:
            full = self.output_sizes[index]
            _check_full_rows(loaded_weight, -(-full // div), dim)
            loaded_weight = _narrow_features(loaded_weight, dim, self._shard_start(index), size, div,
                                             "column-parallel linear")
        if div > 1 and len(self.output_sizes) > 1 and (offset % div or size % div):
            raise ValueError(f"fused projections of sizes {self.sizes_per_rank} (per rank) do not align with the "
                             f"quantization's {div}-feature packs/groups")
        default_weight_loader(param.data.narrow(dim, offset // div, -(-size // div)), loaded_weight)


class QKVLinear(MergedLinear):
    """Fused q/k/v projection (shard ids "q", "k", "v"), column-parallel by heads. With fewer
    KV heads than ranks, each KV head is replicated on the ranks whose query heads use it."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size = get_tp_size()
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        local_heads = _divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            local_kv_heads = _divide(num_kv_heads, tp_size, "num_key_value_heads")
        else:
            if tp_size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size ({tp_size}) must divide num_key_value_heads "
                                 f"({num_kv_heads}) or be a multiple of it")
            local_kv_heads = 1
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias,
                         sizes_per_rank=[local_heads * head_dim, local_kv_heads * head_dim, local_kv_heads * head_dim])
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, local_heads, local_kv_heads

    def _shard_ids(self) -> list:
        return ["q", "k", "v"]

    def _shard_index(self, shard_id) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id]

    def _shard_start(self, index: int) -> int:
        if index == 0:
            return self.tp_rank * self.sizes_per_rank[0]
        if self.total_num_kv_heads >= self.tp_size:
            first_head = self.tp_rank * self.num_kv_heads
        else:  # the KV head of this rank's query heads
            first_head = self.tp_rank * self.total_num_kv_heads // self.tp_size
        return first_head * self.head_dim


class VocabEmbedding(nn.Module):
    """Token embedding table, vocab-parallel: each rank holds ``ceil(vocab / tp)`` rows (the
    last rank's tail zero-padded); ids outside a rank's range embed to 0, an all-reduce sums."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self._partition_vocab(vocab_size)
        self.weight = _parameter(self.vocab_per_rank, hidden_size, weight_loader=self.weight_loader,
                                 full_shape=(vocab_size, hidden_size))

    def _partition_vocab(self, vocab_size: int) -> None:
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = min(self.tp_rank * self.vocab_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.vocab_per_rank, vocab_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_size == 1:
            return default_weight_loader(param, loaded_weight)
        _check_full_rows(loaded_weight, self.vocab_size)
        rows = self.vocab_end - self.vocab_start
        param.data[rows:].zero_()
        default_weight_loader(param.data[:rows], loaded_weight[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
        embedded = F.embedding(local_ids, self.weight).masked_fill_(~mine.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(embedded)


class LMHead(VocabEmbedding):
    """Projects hidden states to vocab logits; ``tie_to`` shares an embedding's weight. Under
    tensor parallelism each rank computes its vocab slice; the slices are all-gathered, so
    every rank holds (and samples from) the full-vocab logits."""

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None):
        nn.Module.__init__(self)  # a tied head must not allocate a second table
        self._partition_vocab(vocab_size)
        self.weight = tie_to.weight if tie_to is not None else _parameter(
            self.vocab_per_rank, hidden_size, weight_loader=self.weight_loader, full_shape=(vocab_size, hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits, dim=-1)[..., :self.vocab_size]
