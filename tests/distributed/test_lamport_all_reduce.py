"""The Lamport all-reduce's protocol (distributed/triton_all_reduce.lamport_all_reduce_kernel) on one
process in Triton's interpreter: rank 0 of two, its peer's message already stored in rank 0's buffer (as
the peer's kernel stores it), the region of the call before holding data. The call stores rank 0's
message, -0.0 made +0.0, into its slot of the peer's buffer (this call's region, nowhere else), sums the
two in float32 as both ranks do, sets the region of the call before back to -0.0 over that call's size,
and moves the state to the next region with this call's size. Buffers are otherwise filled with other
values, so a misplaced read returns wrong sums instead of waiting. Two GPUs: tests/gpu/test_custom_all_reduce.py."""
from __future__ import annotations

import torch

from tests.triton_env import ON_GPU

DEVICE = "cuda" if ON_GPU else "cpu"


def test_one_call_of_rank_0_of_two(monkeypatch):
    from tests.triton_env import kernel_module

    ar = kernel_module("pagedllm.distributed.triton_all_reduce", "lamport_all_reduce_kernel", monkeypatch)
    mark, slot, n, before, block = ar.NEG_ZERO_BITS, 512, 300, 200, 64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g).bfloat16()
    x[:4] = -0.0
    peer = torch.randn(n, generator=g).bfloat16()
    peer[4:9] = 0.0  # the peer sent its -0.0 as +0.0
    # [region, rank slot, elements]; on a GPU the "peer" buffer is simply a second one of this device's
    mine, theirs = (torch.full((3, 2, slot), 7, dtype=torch.int16, device=DEVICE) for _ in range(2))
    mine[2, 1, :n] = peer.view(torch.int16).to(DEVICE)  # this call is in region 2; the peer's message has landed
    bufs = torch.tensor([mine.data_ptr(), theirs.data_ptr()], dtype=torch.int64, device=DEVICE)
    state = torch.tensor([2, 0, 0, before, 0], dtype=torch.int32, device=DEVICE)  # region 1 held `before`
    out = torch.empty(n, dtype=x.dtype, device=DEVICE)
    programs, chunk = ar.launch_shape(n, 4, block)
    ar.lamport_all_reduce_kernel[(programs,)](x.to(DEVICE), out, bufs, state, n, chunk, slot, RANK=0, WORLD=2,
                                              BLOCK=block, num_warps=1)
    mine, theirs, out = mine.cpu(), theirs.cpu(), out.cpu()
    unmarked = torch.where(x == 0, 0.0, x).bfloat16()
    assert torch.equal(out.view(torch.int16), (unmarked.float() + peer.float()).bfloat16().view(torch.int16))
    sent = theirs.clone()
    sent[2, 0, :n] = unmarked.view(torch.int16)
    assert torch.equal(theirs, sent)  # its slot of this call's region, nothing else
    cleared = torch.full((3, 2, slot), 7, dtype=torch.int16)
    cleared[2, 1, :n] = peer.view(torch.int16)
    cleared[1, 1, :before] = mark  # the call before's message, ready for the call after next
    assert torch.equal(mine, cleared)
    assert state.tolist() == [0, 0, 0, before, n]
