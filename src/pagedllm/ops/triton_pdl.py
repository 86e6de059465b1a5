"""Programmatic dependent launch (Hopper's ``griddepcontrol``), shared by the kernels that use it.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream
still runs, once that kernel's programs have all called ``gdc_launch_dependents`` (or ended). It
must call ``gdc_wait`` before it reads what that kernel wrote (and before it writes memory the
other may still read); ``gdc_wait`` returns when the kernel before has ended and its writes are
visible. Used by the LoRA shrink and its GEMM (``triton_lora``, ``triton_gemv``, the norms in
``triton_ops`` that let a shrink launch) and by the fused-MoE chain (``triton_fused_moe``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # Hopper and later, Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None

_CAPABLE: dict[int, bool] = {}


def pdl_capable(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch: an NVIDIA device of
    compute capability 9.0 or later and a Triton that has it."""
    if device.type != "cuda" or torch.version.hip is not None:  # griddepcontrol is NVIDIA's
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = gdc_wait is not None and torch.cuda.get_device_capability(index) >= (9, 0)
    return _CAPABLE[index]


_ENABLED: dict[tuple[int, str], bool] = {}


def pdl_enabled(device: torch.device, switch: str) -> bool:
    """``pdl_capable`` and the environment switch ``switch`` (``PAGEDLLM_LORA_PDL``,
    ``PAGEDLLM_MOE_PDL``, ``PAGEDLLM_DECODE_PDL``) not 0, read once per device and switch: asked
    at every launch."""
    if not pdl_capable(device):
        return False
    key = (device.index if device.index is not None else torch.cuda.current_device(), switch)
    if key not in _ENABLED:
        from pagedllm import envs

        _ENABLED[key] = bool(getattr(envs, switch))
    return _ENABLED[key]


# The most rows (tokens) of a forward whose chain launches early; None: no limit. Set for each model
# by the worker (``set_chain_max_rows``; the model's quantization says: W4A16 limits it).
_CHAIN_MAX_ROWS: int | None = None


def set_chain_max_rows(rows: int | None) -> None:
    global _CHAIN_MAX_ROWS
    _CHAIN_MAX_ROWS = rows


def decode_pdl(device: torch.device, rows: int | None = None) -> bool:
    """Whether the kernels of a layer's chain launch early and wait in-kernel: the projections
    (16-bit small-row GEMMs, FP8's quantize launch and GEMM, the W4A16 split-K GEMM), the norms,
    rotary, the KV write, attention and its split merge, SiLU-and-mul: ``PAGEDLLM_DECODE_PDL``,
    in forwards of at most the model's ``set_chain_max_rows`` rows (``rows``: the launch's)."""
    limit = _CHAIN_MAX_ROWS
    return pdl_enabled(device, "PAGEDLLM_DECODE_PDL") and (rows is None or limit is None or rows <= limit)


def launch_early(early: bool) -> dict:
    """The launch argument that lets a kernel start while the one before it runs."""
    return {"launch_pdl": True} if early else {}


def enter_args(device: torch.device, rows: int | None = None) -> dict:
    """The launch arguments of a kernel in a layer's chain (its ``ENTER`` constexpr, ``pdl_enter``):
    launched early and waiting for the kernel before it where ``decode_pdl`` is on for ``rows``
    (the forward's tokens, which every kernel of its chain sees)."""
    return {"ENTER": (enter := decode_pdl(device, rows)), **launch_early(enter)}


def launch_args(pdl: bool) -> dict:
    """A kernel's launch arguments for its ``PDL`` constexpr: with it, launched early."""
    return {"PDL": pdl, **launch_early(pdl)}


@triton.jit
def pdl_begin(ENTER: tl.constexpr, TRIGGER: tl.constexpr):
    """ENTER (launched early): wait for the kernel before. ENTER or TRIGGER: let the kernel after
    launch now (it waits for this one's writes itself)."""
    if ENTER:
        gdc_wait()
        gdc_launch_dependents()
    elif TRIGGER:
        gdc_launch_dependents()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first step when launched early: wait for the kernel before (its writes are
    complete and visible), then let the kernel after launch (it waits likewise)."""
    pdl_begin(PDL, PDL)
