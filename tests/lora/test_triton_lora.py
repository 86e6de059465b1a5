"""The Triton multi-LoRA kernels (interpreter on CPU) against torch: tokens of several adapters
and of the base model in one launch, ranks and sizes not multiples of the blocks, padded ranks."""
from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x, y, a, b, slots):
    out = y.float().clone()
    for m, s in enumerate(slots.tolist()):
        if s >= 0:
            out[m] += b[s].float() @ (a[s].float() @ x[m].float())
    return out


@pytest.mark.parametrize("m, k, n, r, dtype", [(5, 96, 200, 8, torch.float32), (3, 130, 64, 24, torch.float32),
                                               (7, 64, 150, 16, torch.bfloat16)])
def test_kernels_match_torch_with_mixed_adapters(triton_lora, m, k, n, r, dtype):
    g = torch.Generator().manual_seed(m * 7 + r)
    slots_n = 3
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(m, n, generator=g).to(dtype).to(DEVICE)
    a = (torch.randn(slots_n, r, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(slots_n, n, r, generator=g).to(dtype).to(DEVICE)
    a[2, r // 2:] = 0  # a smaller adapter, zero-padded to the slots' rank
    slots = torch.tensor([(i % (slots_n + 1)) - 1 for i in range(m)], dtype=torch.int64, device=DEVICE)
    want = _reference(x, y, a, b, slots)
    base = y.clone()
    got = triton_lora.lora_apply(x, y, a, b, slots)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol * 10, rtol=tol)
    untouched = slots < 0
    assert torch.equal(got[untouched], base[untouched])  # base-model tokens: bit-identical
