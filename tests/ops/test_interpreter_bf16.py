"""Without a GPU the kernels run in Triton's interpreter, which keeps bfloat16 as raw uint16 bits;
tests/triton_env.py makes its arithmetic and comparisons work on the values, as the GPU's do.
(On a GPU this runs compiled, against the same expectations.)"""
from __future__ import annotations

import torch

from tests.ops.conftest import DEVICE


def test_bfloat16_arithmetic_and_comparisons_are_on_values(triton_ops):
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, y_ptr, diff_ptr, less_ptr):
        r = tl.arange(0, 8)
        x = tl.load(x_ptr + r)
        y = tl.load(y_ptr + r)
        tl.store(diff_ptr + r, x - y)
        tl.store(less_ptr + r, (x < y).to(tl.int32))

    x = torch.tensor([-3.0, -1.0, 0.0, 2.0, -0.5, 5.0, -7.0, 1.0], dtype=torch.bfloat16, device=DEVICE)
    y = torch.tensor([-2.0, -2.0, 1.0, 1.0, -0.25, 6.0, -8.0, 1.0], dtype=torch.bfloat16, device=DEVICE)
    diff = torch.empty_like(x)
    less = torch.empty(8, dtype=torch.int32, device=DEVICE)
    kernel[(1,)](x, y, diff, less)
    assert torch.equal(diff, x - y)
    assert torch.equal(less, (x < y).int())
