"""All-reduce of small activations through peer GPU memory instead of NCCL.

Each tensor-parallel rank holds one buffer of torch's symmetric memory
(``torch.distributed._symmetric_memory``: the same allocation mapped into every rank's address
space over NVLink through CUDA IPC handles, no multicast). An all-reduce is then one kernel:

- **one-shot** (small messages): every rank copies its input into its own buffer, meets the
  others at a barrier on the signal pads, and reads all ranks' buffers to add them up; one
  launch, one trip over NVLink, the latency NCCL's ring pays per step avoided;
- **two-shot** (medium): a reduce-scatter then an all-gather through the buffers, each rank
  reading only ``1/tp`` of every peer's data.

Both kernels come from torch (``torch.ops.symm_mem``). Inside CUDA graphs (decode steps) on two
GPUs, kernels of our own take over (``triton_all_reduce``): bf16 messages up to
``LAMPORT_MAX_BYTES`` take a one-shot whose data is its own flag (each rank stores its message
into the peer's buffer, the peer reads until no element is still -0.0; no fence, no barrier: on 2x
H200 at f90d68b, 256 KiB in 5.3 µs against 7.1 for the one-shot with a barrier, 8 KiB in 4.5);
larger ones, from ``TRITON_MIN_BYTES`` up, a one-shot over many more programs than torch's, so
more bytes are in flight over NVLink, and one barrier a call (on 2x H200 at 710dbd7, 1 MiB takes
9.7 µs against torch's best 14.8, 2 MiB 13.2 against 19.3). Large
messages (prefill chunks) stay on NCCL, which saturates the links there. All replay inside CUDA
graphs (their barriers are device side) and add in a fixed rank order, so every rank holds
bit-identical sums as with NCCL.

The path a tensor takes depends only on its dtype, its size and whether a CUDA graph is being
captured, which every rank shares, so the ranks always meet in the same collective. Where peer
memory is unavailable (no P2P between the GPUs, a torch without symmetric memory, a failed
rendezvous) the engine logs one line and keeps NCCL; ``disable_custom_all_reduce=True`` (vLLM's
flag) keeps NCCL by choice.
"""
from __future__ import annotations

import logging

import torch

from pagedllm import envs

logger = logging.getLogger("pagedllm")

# Message sizes (bytes) up to which each kernel beats NCCL on two H200s over NVLink
# (benchmarks/all_reduce.py; README "Tensor parallelism").
ONE_SHOT_MAX_BYTES = 1 << 20
TWO_SHOT_MAX_BYTES = 8 << 20
# The Triton one-shot from here up (to max_bytes), in CUDA graphs: launched from Python it costs ~15 µs
# more host time than torch's ops, which an eager step (a prefill chunk past the pieces) would wait on.
# Two ranks only (measured and checked on 2x H200; more ranks keep torch's kernels).
TRITON_MIN_BYTES = 256 << 10
_FLAG_BYTES = 64 << 10  # after the data (two halves): the Triton kernel's flags (programs x ranks int32)
_TRITON_BLOCK = 4096  # elements a program moves per iteration
# The Lamport one-shot (``triton_all_reduce.lamport_all_reduce_kernel``): bf16 messages up to this size in
# CUDA graphs, two ranks (measured on 2x H200); its buffer holds three regions of one slot per rank.
LAMPORT_MAX_BYTES = 1 << 20
_LAMPORT_BLOCK = 1024  # elements a program moves per iteration (4 warps: 16 bytes a thread)
_DTYPES = (torch.bfloat16, torch.float32)  # what torch's symmetric-memory kernels add


class CustomAllReduce:
    """Sums tensors over one tensor-parallel group through a symmetric-memory buffer of
    ``max_bytes``. Build it on every rank of the group at once (the rendezvous is collective)."""

    def __init__(self, group_name: str, device: torch.device, max_bytes: int = TWO_SHOT_MAX_BYTES,
                 one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES, lamport_max_bytes: int = LAMPORT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, harmless after
            symm_mem.enable_symm_mem_for_group(group_name)
        self.group_name = group_name
        self.max_bytes = max_bytes
        self.one_shot_max_bytes = min(one_shot_max_bytes, max_bytes)
        self.buffer = symm_mem.empty(2 * max_bytes + _FLAG_BYTES, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group_name)
        self.world_size, self.rank = self.handle.world_size, self.handle.rank
        self.triton_min_bytes = TRITON_MIN_BYTES if self.world_size == 2 else max_bytes + 1
        lamport = self.world_size == 2 and envs.PAGEDLLM_LAMPORT_ALL_REDUCE
        self.lamport_max_bytes = min(lamport_max_bytes, max_bytes) if lamport else 0  # what all_reduce sends it
        self.lamport_slot = self.lamport_max_bytes // 2  # elements a rank's message takes in a region
        # Every rank's buffer and flag area by address, for the Triton kernel; flags start at 0 on every
        # rank before any rank's kernel can set one (the device-side barrier after the memset).
        ptrs = list(self.handle.buffer_ptrs)
        self._bufs = torch.tensor(ptrs, dtype=torch.int64, device=device)
        self._flags = torch.tensor([p + 2 * max_bytes for p in ptrs], dtype=torch.int64, device=device)
        self._state = torch.zeros(2, dtype=torch.int32, device=device)
        self.buffer[2 * max_bytes:].zero_()
        self._lamport_state = torch.zeros(5, dtype=torch.int32, device=device)  # region, programs done, 3 sizes
        if self.lamport_slot:
            from pagedllm.distributed.triton_all_reduce import NEG_ZERO_BITS

            self.lamport_buffer = symm_mem.empty(3 * self.world_size * 2 * self.lamport_slot, dtype=torch.uint8,
                                                 device=device)
            handle = symm_mem.rendezvous(self.lamport_buffer, group_name)
            self._lamport_bufs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
            self.lamport_buffer.view(torch.int16).fill_(NEG_ZERO_BITS)  # every element "not arrived"
        self.handle.barrier()
        self._max_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        for dtype in _DTYPES if self.triton_min_bytes <= max_bytes else ():
            x = torch.zeros(_TRITON_BLOCK, dtype=dtype, device=device)  # compiled and loaded now, not first
            self._triton_one_shot(x, torch.empty_like(x))  # inside a graph capture (collective: every rank)
        if self.lamport_slot:
            x = torch.zeros(_LAMPORT_BLOCK, dtype=torch.bfloat16, device=device)
            self._lamport(x, torch.empty_like(x))

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through peer memory (else NCCL); the same answer on every rank."""
        nbytes = x.numel() * x.element_size()
        return x.is_cuda and x.dtype in _DTYPES and 0 < nbytes <= self.max_bytes and nbytes % 16 == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, as a new tensor shaped like ``x``."""
        x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        buf = self.buffer[:nbytes].view(x.dtype)
        out = torch.empty_like(x)
        capturing = torch.cuda.is_current_stream_capturing()
        rows = x.shape[0] if x.dim() > 1 else None  # the forward's tokens (whether the chain launches early)
        if capturing and nbytes <= self.lamport_max_bytes and x.dtype == torch.bfloat16:
            self._lamport(x.view(-1), out.view(-1), rows)
        elif nbytes >= self.triton_min_bytes and capturing:
            self._triton_one_shot(x.view(-1), out.view(-1), rows)
        elif nbytes <= self.one_shot_max_bytes:
            # The kernel copies x into this rank's buffer itself, then sums every rank's buffer.
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, x.view(-1), "sum", self.group_name, out.view(-1))
        else:
            buf.copy_(x.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", self.group_name, out.view(-1))
        return out

    def _triton_one_shot(self, x: torch.Tensor, out: torch.Tensor, rows: int | None = None) -> None:
        from pagedllm.distributed.triton_all_reduce import launch_shape, one_shot_all_reduce_kernel
        from pagedllm.ops.triton_pdl import enter_args

        n = x.numel()
        programs, chunk = launch_shape(n, self._max_programs, _TRITON_BLOCK)
        one_shot_all_reduce_kernel[(programs,)](x, out, self._bufs, self._flags, self._state, n, chunk,
                                                self.max_bytes // x.element_size(), RANK=self.rank,
                                                WORLD=self.world_size, BLOCK=_TRITON_BLOCK, num_warps=8,
                                                **enter_args(x.device, rows))

    def _lamport(self, x: torch.Tensor, out: torch.Tensor, rows: int | None = None) -> None:
        from pagedllm.distributed.triton_all_reduce import lamport_all_reduce_kernel, launch_shape
        from pagedllm.ops.triton_pdl import enter_args

        n = x.numel()
        programs, chunk = launch_shape(n, self._max_programs, _LAMPORT_BLOCK)
        lamport_all_reduce_kernel[(programs,)](x, out, self._lamport_bufs, self._lamport_state, n, chunk,
                                               self.lamport_slot, RANK=self.rank, WORLD=self.world_size,
                                               BLOCK=_LAMPORT_BLOCK, num_warps=4, **enter_args(x.device, rows))


def make_custom_all_reduce(group, device: torch.device) -> CustomAllReduce | None:
    """The group's peer-memory all-reduce, or None where it cannot work (logged, except on CPU
    devices: gloo ranks have no peer memory); collective on GPUs: every rank of ``group`` calls
    it, and all get one or all get None."""
    import torch.distributed as dist

    if device.type != "cuda":
        return None

    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    reason = _unavailable_reason(device, len(ranks))
    ok = torch.tensor([0 if reason else 1], device=device, dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # one rank without P2P: nobody uses it
    if reason is None and not int(ok.item()):
        reason = "another rank cannot map peer memory"
    if reason is None:
        try:
            comm = CustomAllReduce(group.group_name, device)
        except Exception as e:  # noqa: BLE001 - a driver or torch that refuses: NCCL still works
            reason = f"symmetric-memory rendezvous failed ({type(e).__name__}: {e})"
        else:
            if dist.get_rank(group) == 0:
                triton = f"; in CUDA graphs the Triton one-shot from {comm.triton_min_bytes >> 10} KiB" \
                    if comm.triton_min_bytes <= comm.max_bytes else ""
                if comm.lamport_max_bytes:
                    triton += f" (bf16 up to {comm.lamport_max_bytes >> 10} KiB: the Lamport one-shot)"
                logger.info("Custom all-reduce over peer memory on %d GPUs (one-shot up to %d KiB, two-shot up "
                            "to %d MiB%s, NCCL above)", len(ranks), comm.one_shot_max_bytes >> 10,
                            comm.max_bytes >> 20, triton)
            return comm
    if dist.get_rank(group) == 0:
        logger.warning("Custom all-reduce off (%s): tensor-parallel all-reduces use NCCL", reason)
    return None


def _unavailable_reason(device: torch.device, world_size: int) -> str | None:
    if world_size > 8:
        return f"{world_size} ranks (symmetric-memory kernels handle up to 8)"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return "this torch has no symmetric memory"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return "this torch's symmetric memory lacks one_shot_all_reduce_copy_out"
    n = torch.cuda.device_count()
    here = device.index if device.index is not None else torch.cuda.current_device()
    if not all(torch.cuda.can_device_access_peer(here, other) for other in range(n) if other != here):
        return "no peer access between this host's GPUs"
    return None
