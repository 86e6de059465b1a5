"""The Triton multi-LoRA kernels (interpreter on CPU) against torch: tokens of several adapters
and of the base model in one launch (tiles of one adapter each, padded), ranks and sizes not
multiples of the blocks, zero-padded ranks; base-model rows untouched."""
from __future__ import annotations

import numpy as np
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x, y, a, b, slots):
    out = y.float().clone()
    for m, s in enumerate(slots.tolist()):
        if s >= 0:
            out[m] += b[s].float() @ (a[s].float() @ x[m].float())
    return out


def test_sort_by_slot_pads_each_adapter_to_whole_tiles(triton_lora):
    ids, tiles = triton_lora.sort_by_slot(np.array([2, -1, 0, 2, 2, 0, -1]), block_m=2)
    assert ids.tolist() == [2, 5, 0, 3, 4, -1] and tiles.tolist() == [0, 2, 2]
    ids, tiles = triton_lora.sort_by_slot(np.array([-1, -1]))
    assert len(ids) == 0 and len(tiles) == 0


@pytest.mark.parametrize("m, k, n, r, dtype", [(5, 96, 200, 8, torch.float32), (40, 130, 64, 24, torch.float32),
                                               (7, 64, 150, 16, torch.bfloat16),
                                               (3, 1100, 72, 16, torch.float32)])  # K split over programs
def test_kernels_match_torch_with_mixed_adapters(triton_lora, m, k, n, r, dtype):
    g = torch.Generator().manual_seed(m * 7 + r)
    slots_n = 3
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(m, n, generator=g).to(dtype).to(DEVICE)
    a = (torch.randn(slots_n, r, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(slots_n, n, r, generator=g).to(dtype).to(DEVICE)
    a[2, r // 2:] = 0  # a smaller adapter, zero-padded to the slots' rank
    slots = np.array([(i % (slots_n + 1)) - 1 for i in range(m)])
    slots[:m // 2] = 1  # one adapter with more than a tile of tokens
    want = _reference(x, y, a, b, torch.from_numpy(slots))
    base = y.clone()
    if k > 256:
        assert triton_lora.split_k(4, 1, m, n, r, k)[0] > 1
    ids, tiles = triton_lora.sort_by_slot(slots)
    got = triton_lora.lora_apply(x, y, a, b, torch.from_numpy(ids).to(DEVICE), torch.from_numpy(tiles).to(DEVICE))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol * 10, rtol=tol)
    untouched = torch.from_numpy(slots < 0).to(DEVICE)
    assert torch.equal(got[untouched], base[untouched])  # base-model tokens: bit-identical


def test_split_k_only_for_few_tiles_and_covers_k(triton_lora):
    assert triton_lora.split_k(300, 1, 8192, 4096, 16, 4096) == (1, 4096)  # a prefill: enough programs
    for m, k, r in [(1, 4096, 48), (1, 14336, 16), (32, 4096, 32), (256, 4096, 48)]:
        split, per = triton_lora.split_k(5, 1, m, 6144, r, k)
        assert per % 64 == 0 and split * per >= k > (split - 1) * per
    assert triton_lora.split_k(5, 1, 1, 6144, 48, 4096)[0] >= 8  # batch-1 decode: many programs
    assert triton_lora.split_k(12, 1, 256, 28672, 32, 4096)[0] == 1  # re-reads would cost more


def test_padding_tiles_of_slot_minus_one_change_nothing(triton_lora):
    """A CUDA graph's grid is fixed: the tiles past the step's are slot -1 (and ids -1)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, generator=g).to(DEVICE)
    y = torch.randn(4, 48, generator=g).to(DEVICE)
    a, b = torch.randn(2, 16, 32, generator=g).to(DEVICE), torch.randn(2, 48, 16, generator=g).to(DEVICE)
    slots = np.array([1, -1, 0, 1])
    ids, tiles = triton_lora.sort_by_slot(slots)
    pad = triton_lora.max_tiles(4, 2) - len(tiles)
    ids = np.concatenate([ids, np.full(pad * triton_lora.BLOCK_M, -1)])
    tiles = np.concatenate([tiles, np.full(pad, -1)])
    want = _reference(x, y, a, b, torch.from_numpy(slots))
    got = triton_lora.lora_apply(x, y, a, b, torch.from_numpy(ids).to(DEVICE), torch.from_numpy(tiles).to(DEVICE))
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
