"""Piecewise CUDA graphs: steps that carry a prefill chunk, captured between the attention calls.

A decode step replays one graph of the whole forward (``cuda_graphs.CudaGraphs``); a step that
carries a prefill chunk cannot, because attention's work depends on each request's query and
context lengths. Run eagerly, such a forward is some ten launches a layer issued from Python, and
on the H100 hosts that is 20-45 ms of host time a step (``scripts/mixed_step_probe.py``), several
times what the GPU needs up to a few thousand tokens. Here the forward is captured in pieces
for a set of padded token counts: piece 0 runs from the embedding to layer 0's attention, piece i
from layer i - 1's attention output to layer i's attention inputs, the last to the final norm.
A step pads its tokens to the next captured count and replays piece 0 (which ends with layer 0's
KV write, over the fixed slot-mapping buffer: padding rows have slot -1), runs layer 0's attention
eagerly on the real tokens with the step's metadata, replays piece 1, and so on (vLLM's
piecewise graphs, which it cuts with torch.compile; here the attention backend is the cut).
Padding rows go through the projections like any row and never reach attention or the cache;
every op outside attention treats rows independently, so the real rows are exact.

Capture swaps each attention layer's backend for a stand-in whose ``forward`` captures the KV
write (``write_kv``), ends the piece being captured, records the call (its q: a tensor in the
graphs' memory pool) and returns a fixed output buffer that the next piece reads, then begins the
next piece (a layer that calls the backend's ``rotary_write_kv`` has that captured as it is, and
its ``attend`` cuts the same way); a replay calls the backend's ``attend``. The q is kept as a
non-owning view: its memory may be handed to later pieces of the same forward, which at replay
run only after the attention that reads it (replays run in capture order, on one stream).
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging

import torch
from torch import nn

from pagedllm import envs
from pagedllm.attention.backend import AttentionMetadata

logger = logging.getLogger("pagedllm")


def piecewise_sizes(max_tokens: int) -> list[int]:
    """The padded token counts captured, up to ``max_tokens``: every 32 to 256, then four per
    doubling (a step past 256 tokens pads by less than a quarter), and ``max_tokens`` itself."""
    sizes, step, t = [], 32, 32
    while t < max_tokens:
        sizes.append(t)
        if t >= 8 * step:
            step *= 2
        t += step
    return sizes + [max_tokens] if max_tokens > 0 else []


def _weak_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep it allocated (through the CUDA array
    interface, which torch imports without taking ownership). 16-bit floats travel as int16."""
    raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t
    typestr = {torch.int16: "<i2", torch.int32: "<i4"}.get(raw.dtype)
    if typestr is None:
        raise TypeError(f"piecewise graphs: no weak view of {t.dtype}")

    class _Array:
        __cuda_array_interface__ = {
            "data": (raw.data_ptr(), False), "shape": tuple(raw.shape), "typestr": typestr, "version": 2,
            "strides": tuple(s * raw.element_size() for s in raw.stride()),
        }

    return torch.as_tensor(_Array(), device=t.device).view(t.dtype)


def capture_sets(graphs: dict, lora_graphs: dict, lora, sizes: list[int], capture_one) -> None:
    """Fill ``graphs`` at every size, largest first, and with ``lora`` (a LoRA manager whose
    kernels can be captured, else None) ``lora_graphs`` too, its tokens mapped through the
    manager's fixed buffers of each size: ``capture_one(size, warm_up)`` returns one size's graphs.
    Only the largest size of a set warms up eagerly (``CudaGraphs.capture`` says why)."""
    for target, mapping in [(graphs, None)] + ([(lora_graphs, lora)] if lora is not None else []):
        for n in reversed(sizes):
            if mapping is not None:
                mapping.capture_mapping(n)
            target[n] = capture_one(n, n == sizes[-1])
        if mapping is not None:
            mapping.clear_mapping()


@dataclasses.dataclass
class _Call:
    """One attention call between two pieces, as ``Attention.attend`` made it at capture."""
    layer: nn.Module
    backend: object
    q: torch.Tensor
    out: torch.Tensor
    scale: float
    args: tuple
    kwargs: dict


class _Cut:
    """A layer's attention backend while a size is captured: the piece ends at the call."""

    def __init__(self, owner: "PiecewiseGraphs", layer: nn.Module, backend) -> None:
        self.owner, self.layer, self.backend = owner, layer, backend

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    def forward(self, query, key, value, kv_cache, metadata, scale, *args, **kwargs):
        # The KV write stays in the piece: it reads only the slot mapping's fixed buffer.
        self.backend.write_kv(key, value, kv_cache, metadata, kwargs.get("kv_scale"))
        return self.owner.cut(self.layer, self.backend, query, scale, args, kwargs)

    def attend(self, query, kv_cache, metadata, scale, *args, **kwargs):
        # After the backend's rotary_write_kv (captured in the piece, as the KV write above).
        return self.owner.cut(self.layer, self.backend, query, scale, args, kwargs)


class PiecewiseGraphs:
    """The piecewise graphs of one runner's model, by padded token count."""

    def __init__(self, buffers, device: torch.device, max_tokens: int, block_size: int,
                 attn_layers: list[nn.Module]) -> None:
        self.buffers = buffers
        self.attn_layers = attn_layers
        self.device = device
        self.block_size = block_size
        self.candidate_sizes = piecewise_sizes(max_tokens)
        self.sizes: list[int] = []  # captured, ascending (empty: such steps run eagerly)
        self.graphs: dict[int, tuple[list[torch.cuda.CUDAGraph], list[_Call], torch.Tensor]] = {}
        self.lora_graphs: dict[int, tuple[list[torch.cuda.CUDAGraph], list[_Call], torch.Tensor]] = {}  # with adapters
        self._outs: dict[tuple, torch.Tensor] = {}  # attention outputs, by (row shape, dtype): outside the pool
        self._capturing: tuple[list, list, object] | None = None  # (pieces, calls, pool) of the size in capture
        self.replays = 0  # steps served (tests read it)
        self.lora_replays = 0  # of which with adapters

    def size_for(self, num_tokens: int, lora: bool = False) -> int | None:
        if lora and not self.lora_graphs:
            return None
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def _out_buffer(self, query: torch.Tensor, rows: int) -> torch.Tensor:
        key = (tuple(query.shape[1:]), query.dtype)
        buf = self._outs.get(key)
        if buf is None:
            buf = self._outs[key] = torch.empty((self.candidate_sizes[-1], *key[0]), dtype=query.dtype,
                                                device=self.device)
        return buf[:rows]

    def cut(self, layer, backend, query, scale, args, kwargs) -> torch.Tensor:
        pieces, calls, pool = self._capturing
        pieces[-1].capture_end()
        out = self._out_buffer(query, query.shape[0])  # allocated outside capture: not in the pool
        calls.append(_Call(layer, backend, _weak_view(query), out, scale, args, kwargs))
        graph = torch.cuda.CUDAGraph()
        pieces.append(graph)
        graph.capture_begin(pool=pool)
        return out

    def warm_up_metadata(self, n: int) -> AttentionMetadata:
        """One prompt of ``n`` tokens that writes no slot, over block 0 (start-up's forward)."""
        blocks = -(-n // self.block_size)
        return AttentionMetadata(
            num_actual_tokens=n, slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros(1, blocks, dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            query_start_loc_cpu=[0, n], seq_lens_cpu=[n], max_query_len=n, max_seq_len=n)

    def capture_metadata(self, n: int) -> AttentionMetadata:
        """The warm-up metadata, its slot mappings the fixed buffers a step uploads (padded with -1):
        the KV writes captured in the pieces read them."""
        buf = self.buffers
        md = self.warm_up_metadata(n)
        md.slot_mapping = buf.slot_mapping[:n].fill_(-1)
        if buf.num_kv_groups > 1:
            md.with_groups([(md.block_tables, buf.dev[f"slot_mapping_{g}"][:n].fill_(-1))
                            for g in range(1, buf.num_kv_groups)])
        return md

    def capture(self, model: nn.Module, pool, stream: torch.cuda.Stream, lora=None) -> None:
        """Capture every size, largest first, into ``pool`` on ``stream``; with ``lora`` (a
        ``LoRAManager`` whose kernels can be captured) every size again with its adapters, over the
        manager's fixed token-to-slot buffers (``LoRAManager.capture_mapping``)."""
        self.buffers.input_ids.zero_()
        self.buffers.positions.zero_()
        capture_sets(self.graphs, self.lora_graphs, lora, self.candidate_sizes,
                     lambda n, warm_up: self._capture_size(model, n, pool, stream, warm_up))
        self.sizes = list(self.candidate_sizes)

    def _capture_size(self, model: nn.Module, n: int, pool, stream: torch.cuda.Stream, warm_up: bool):
        """The pieces, calls and output of the forward over ``n`` tokens (``warm_up``: run it
        eagerly first)."""
        buf, attn_layers = self.buffers, self.attn_layers
        if warm_up:
            model(buf.input_ids[:n], buf.positions[:n], self.warm_up_metadata(n))
            torch.cuda.synchronize(self.device)
        args = (buf.input_ids[:n], buf.positions[:n], self.capture_metadata(n))
        backends = [layer.attn_backend for layer in attn_layers]
        for layer, backend in zip(attn_layers, backends):
            layer.attn_backend = _Cut(self, layer, backend)
        pieces, calls = [torch.cuda.CUDAGraph()], []
        self._capturing = (pieces, calls, pool)
        try:
            with torch.cuda.stream(stream):
                pieces[0].capture_begin(pool=pool)
                try:
                    out = model(*args)
                except Exception as e:  # e.g. a layer that reads a device value on the host
                    with contextlib.suppress(Exception):
                        pieces[-1].capture_end()
                    raise RuntimeError(f"capturing the forward of {n} tokens in pieces failed ({e}); "
                                       "PAGEDLLM_PIECEWISE_GRAPH_TOKENS=0 runs steps with prefill chunks "
                                       "eagerly") from e
                pieces[-1].capture_end()
        finally:
            self._capturing = None
            for layer, backend in zip(attn_layers, backends):
                layer.attn_backend = backend
        if not calls:  # attention that bypassed the backend would be baked into the graph
            raise RuntimeError("piecewise capture: the forward made no call to an attention backend")
        return pieces, calls, out

    def replay(self, size: int, num_tokens: int, md: AttentionMetadata, lora: bool = False) -> torch.Tensor:
        """The forward of a step whose ``num_tokens`` inputs are uploaded (padded to ``size``),
        attention over ``md``; the first ``num_tokens`` rows of the output. ``lora``: the graphs
        with adapters, whose token-to-slot buffers the step filled (``LoRAManager.prepare_step``)."""
        pieces, calls, out = (self.lora_graphs if lora else self.graphs)[size]
        n = num_tokens
        for piece, call in zip(pieces, calls):
            piece.replay()
            layer = call.layer
            call.backend.attend(call.q[:n], layer.kv_cache, md.for_group(layer.kv_cache_group), call.scale,
                                *call.args, out=call.out[:n], **call.kwargs)
        pieces[-1].replay()
        self.replays += 1
        self.lora_replays += lora
        return out[:n]

    def release(self) -> None:
        self.graphs = {}  # the calls' weak views go with the graphs that own their memory
        self.lora_graphs = {}
        self.sizes = []
        self._outs = {}


def piecewise_graphs_for(runner) -> PiecewiseGraphs | None:
    """The runner's piecewise graphs, or None where steps with prefill chunks stay eager: on CPU,
    with an attention backend that cannot be captured, ``enforce_eager``, pipeline stages,
    encoder pooling models (their forward takes token types), speculative decoding (its proposers
    read the target's forward as it runs), or ``PAGEDLLM_PIECEWISE_GRAPH_TOKENS=0``. Steps with
    LoRA adapters replay graphs of their own where the adapters' kernels can be captured
    (``LoRAManager.graphs_supported``)."""
    max_tokens = min(envs.PAGEDLLM_PIECEWISE_GRAPH_TOKENS, runner.max_num_tokens)
    if runner.device.type != "cuda" or not runner.graphs.graph_safe or runner.config.model_config.enforce_eager \
            or runner.pp_size > 1 or (runner.pooling is not None and runner.pooling.is_encoder) \
            or runner.draft is not None or max_tokens < 32:
        return None
    return PiecewiseGraphs(runner._buffers, runner.device, max_tokens, runner.block_size, runner.attn_layers)
