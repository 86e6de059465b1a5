"""Two KV cache groups in one cache tensor (core/kv_cache_groups.py): a full-attention layer and a
sliding-window layer share the tensor (slot 0 of each group), each reading and writing through
its group's block table and slot mapping (``AttentionMetadata.for_group``). After the sliding
group's out-of-window blocks are reused by the full group, both layers still attend exactly as
with private caches, through the torch backend and the Triton kernels (the interpreter on CPU)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend
from tests.triton_env import ON_GPU

DEVICE = "cuda" if ON_GPU else "cpu"
BS, WINDOW, KVH, HEADS, HD = 4, 5, 2, 4, 32


def _metadata(tables: list[list[int]], positions: list[range]) -> AttentionMetadata:
    """One request per table; each computes ``positions`` this step (after those before)."""
    qsl, slots = [0], []
    for table, pos in zip(tables, positions):
        qsl.append(qsl[-1] + len(pos))
        slots += [table[p // BS] * BS + p % BS for p in pos]
    seq_lens = [pos.stop for pos in positions]
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]

    def dev(x, dtype):
        return torch.tensor(x, dtype=dtype, device=DEVICE)

    return AttentionMetadata(
        num_actual_tokens=qsl[-1], slot_mapping=dev(slots, torch.int64), block_tables=dev(padded, torch.int32),
        query_start_loc=dev(qsl, torch.int32), seq_lens=dev(seq_lens, torch.int32), query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens, max_query_len=max(len(p) for p in positions), max_seq_len=max(seq_lens))


def _grouped(full_tables, sliding_tables, positions) -> AttentionMetadata:
    md = _metadata(full_tables, positions)
    other = _metadata(sliding_tables, positions)
    return md.with_groups([(other.block_tables, other.slot_mapping)])


def _run(backend, steps, private: bool) -> list[torch.Tensor]:
    """Each step: (metadata, q/k/v per layer); layer 0 full (group 0), layer 1 sliding (group 1)."""
    caches = [torch.zeros(2, 24, BS, KVH, HD, device=DEVICE) for _ in range(2 if private else 1)]
    outs = []
    for md_by_layer, qkv in steps:
        for layer, window in enumerate((None, WINDOW)):
            cache = caches[layer if private else 0]
            md = md_by_layer[layer] if private else md_by_layer.for_group(layer)
            q, k, v = qkv[layer]
            outs.append(backend.forward(q, k, v, cache, md, HD ** -0.5, sliding_window=window))
    return outs


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    if request.param == "torch":
        return TorchAttentionBackend()
    kernels = request.getfixturevalue("kernels")  # the interpreter without a GPU
    del kernels
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def test_layers_of_two_groups_share_a_cache_tensor_through_their_own_tables(backend):
    gen = torch.Generator().manual_seed(0)

    def qkv(n):
        return [tuple(torch.randn(n, h, HD, generator=gen).to(DEVICE) for h in (HEADS, KVH, KVH)) for _ in range(2)]

    # Step 1: request A prefills 12 tokens, B 6. Full blocks A [0, 1, 2], B [3, 4]; sliding A [5, 6, 7], B [8, 9].
    p1 = [range(0, 12), range(0, 6)]
    step1 = (qkv(18), p1)
    # Step 2: A runs 3 tokens (12..14: keys > 7 only), B decodes position 6. The sliding group has
    # freed A's blocks 5 and 6 (positions 0..7): the full group took block 6 for A's positions 12..15;
    # the sliding table keeps stale ids there (NULL_BLOCK 0, or the old id), read only masked.
    p2 = [range(12, 15), range(6, 7)]
    step2 = (qkv(4), p2)
    full = [[0, 1, 2, 6], [3, 4]]
    sliding = [[0, 6, 7, 10], [8, 9]]
    shared = _run(backend, [(_grouped([[0, 1, 2], [3, 4]], [[5, 6, 7], [8, 9]], p1), step1[0]),
                            (_grouped(full, sliding, p2), step2[0])], private=False)
    private_tables = [[0, 1, 2, 3], [4, 5]]
    private = _run(TorchAttentionBackend(), [((_metadata(private_tables, p1),) * 2, step1[0]),
                                             ((_metadata(private_tables, p2),) * 2, step2[0])], private=True)
    for got, want in zip(shared, private):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
