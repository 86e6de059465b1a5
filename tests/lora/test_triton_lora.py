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
                                               (3, 1100, 72, 16, torch.float32),  # K split over programs
                                               (1, 4096, 512, 48, torch.bfloat16)])  # batch 1: a 16-way split
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
    config = None
    if k > 256 and m > 1:  # K split over programs whose K is not a multiple of the block
        config = {"split": 4, "block_k": 64, "block_n": 64}
        assert triton_lora.split_k(k, 4, 64) == (4, 320)
    if m == 1:  # the default config of a batch-1 step, with the expand on its own (a float32 adapter's way)
        assert triton_lora.default_config(1, 1, m, n, k)["split"] == 16
        slots[:] = 1
        want = _reference(x, y, a, b, torch.from_numpy(slots))
    ids, tiles = triton_lora.sort_by_slot(slots)
    got = triton_lora.lora_apply(x, y, a, b, torch.from_numpy(ids).to(DEVICE), torch.from_numpy(tiles).to(DEVICE),
                                 config)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol * 10, rtol=tol)
    untouched = torch.from_numpy(slots < 0).to(DEVICE)
    assert torch.equal(got[untouched], base[untouched])  # base-model tokens: bit-identical


def test_k_split_only_for_steps_of_few_tiles(triton_lora):
    assert triton_lora.default_config(260, 1, 8192, 4096, 4096)["split"] == 1  # a prefill: programs enough
    assert triton_lora.default_config(5, 1, 1, 6144, 4096)["split"] == 16  # batch-1 decode: K 256 a program,
    assert triton_lora.default_config(5, 1, 1, 28672, 4096)["split"] == 16  # wide projections too (a GEMV reads
    assert triton_lora.default_config(5, 1, 8, 28672, 4096)["split"] == 4  # the partials; the expand, re-reading
    # them per output tile, splits less)
    assert triton_lora.default_config(5, 1, 1, 4096, 14336)["split"] == triton_lora.MAX_SPLIT
    assert triton_lora.default_config(5, 1, 1, 6144, 256)["split"] == 1  # too little K to split
    for k, split, block_k in [(4096, 8, 128), (14336, 8, 128), (1100, 4, 64), (64, 8, 64)]:
        got, per = triton_lora.split_k(k, split, block_k)
        assert per % block_k == 0 and got * per >= k > (got - 1) * per and got <= split


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


@pytest.mark.parametrize("m, kernel, split", [(1, "gemv", 1), (1, "gemv", 4), (6, "dot", 2), (20, "dot", 1),
                                             (70, "dot", 2), (6, "linear", 2), (1, "linear_fp32_adapter", 4)])
def test_small_row_gemm_adds_the_expand_in_its_epilogue(triton_lora, triton_gemv, triton_ops, m, kernel, split):
    """A decode step's expand fused into the small-row GEMM: the rows of each adapter get their
    own delta, base-model rows exactly the plain GEMM's; rank 40 spans two rank blocks; 70 rows in
    row tiles of 64 (each tile's rows their own slots)."""
    g = torch.Generator().manual_seed(m + split)
    k, n, r, dtype = 512, 96, 40, torch.bfloat16
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    lora_dtype = torch.float32 if kernel.endswith("fp32_adapter") else dtype  # lora_dtype="float32"
    a = (torch.randn(3, r, k, generator=g) / k ** 0.5).to(DEVICE, lora_dtype)
    b = (torch.randn(3, n, r, generator=g) * 0.1).to(DEVICE, lora_dtype)
    slots = np.array([(2 - i) % 4 - 1 if m > 1 else 1 for i in range(m)])  # 1, 0, -1, 2, ...
    ids, tiles = triton_lora.sort_by_slot(slots)
    delta = triton_lora.lora_shrink(x, a, b, torch.from_numpy(ids).to(DEVICE), torch.from_numpy(tiles).to(DEVICE),
                                    torch.from_numpy(slots).to(DEVICE), {"split": split, "block_k": 64, "block_n": 64},
                                    pdl=triton_lora.pdl_supported(torch.device(DEVICE)))  # on a GPU: the GEMM
    # launched while the shrink runs (programmatic dependent launch) where the device has it
    assert delta.split == split
    if kernel.startswith("linear"):  # the engine's dispatch: F.linear for a weight this small (6 rows), and
        # the expand its own launch there and for an adapter of another dtype than the weight
        got, plain = triton_ops.linear(x, w, lora=delta), triton_ops.linear(x, w)
    else:
        got = triton_gemv.small_m_linear(x, w, kernel=kernel, block_n=32, lora=delta)
        plain = triton_gemv.small_m_linear(x, w, kernel=kernel, block_n=32)
    want = x.float() @ w.float().T
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want[i] += b[s].float() @ (a[s].float() @ x[i].float())
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)
    base = torch.from_numpy(slots < 0).to(DEVICE)
    assert torch.equal(got[base], plain[base])
    if not kernel.startswith("linear"):
        with pytest.raises(ValueError, match="LoRA delta"):
            triton_gemv.small_m_linear(x, w[:48], kernel=kernel, lora=delta)  # another projection
