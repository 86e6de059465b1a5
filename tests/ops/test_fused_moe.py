"""The fused-MoE Triton kernel against the torch reference (Triton's interpreter without a GPU):
random inputs, uneven expert loads, an expert no token picks, tiles taller than an expert's run,
hidden and intermediate sizes not multiples of the tiles, experts held by another rank (expert
parallelism). And the torch reference itself against a per-token loop, and routing as
transformers routes."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pagedllm.ops.fused_moe import fused_experts_bmm_loop, fused_experts_torch, route
from pagedllm.ops.moe_scales import WEIGHT_FORMATS, ExpertScales, weight_format
from pagedllm.ops.tile_tables import TileTable, read_table
from tests.ops.conftest import DEVICE

NUM_EXPERTS, HIDDEN, INTER = 6, 40, 24


def _inputs(num_tokens: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5
    # Uneven loads: expert 0 is favoured, expert 3 is never picked.
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=g) + torch.tensor([2.0, 0.5, 0.0, -1e4, -0.5, 0.3])
    weights, ids = route(logits, top_k, renormalize=True)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def _per_token_loop(x, w13, w2, weights, ids):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (w2[e].double() @ (F.silu(gate) * up))
    return out


def test_torch_reference_equals_a_per_token_loop():
    x, w13, w2, weights, ids = (t.cpu() for t in _inputs(23, 2, torch.float32))
    assert 3 not in ids.tolist() and (ids == 0).sum() > (ids == 2).sum()  # uneven, one expert idle
    exact = _per_token_loop(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_experts_torch(x, w13, w2, weights, ids).double(), exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_experts_bmm_loop(x, w13, w2, weights, ids).double(), exact, atol=1e-5, rtol=1e-5)
    # Expert parallelism: two "ranks" holding experts {0, 2, 4} and {1, 3, 5} sum to the whole.
    halves = []
    for rank in range(2):
        mine = torch.arange(rank, NUM_EXPERTS, 2)
        expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.long)
        expert_map[mine] = torch.arange(len(mine))
        halves.append(fused_experts_torch(x, w13[mine], w2[mine], weights, ids, expert_map))
    torch.testing.assert_close((halves[0] + halves[1]).double(), exact, atol=1e-5, rtol=1e-5)


def test_sigmoid_routing_and_renormalisation():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    weights, ids = route(logits, 2, scoring="sigmoid")
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[2.0, 1.0]])))
    weights, _ = route(logits, 2, scoring="softmax", renormalize=True)
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))
    with pytest.raises(ValueError, match="scoring function 'relu'"):
        route(logits, 2, scoring="relu")


def test_align_pairs_groups_by_expert_and_pads_each_run(triton_moe_routing):
    ids = torch.tensor([[2, 0], [2, 1], [2, 0], [-1, 2]])  # expert 3 idle; one pair on another rank
    sorted_pairs, block_expert = triton_moe_routing.align_pairs(ids, num_experts=4, block_m=2)
    pad = ids.numel()
    assert block_expert.tolist()[:4] == [0, 1, 2, 2] and set(block_expert.tolist()[4:]) == {-1}
    assert sorted_pairs.tolist()[:8] == [1, 5, 3, pad, 0, 2, 4, 7]
    assert set(sorted_pairs.tolist()[8:]) == {pad}


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [(4, 2, 4, 2), (1, 8, 32, 16), (37, 3, 6, 16)])
def test_one_launch_align_gives_the_torch_layout(triton_moe_routing, num_tokens, top_k, num_experts, block_m):
    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g)
    ids[0, 0] = -1  # a pair on another rank
    ids[ids == 1] = 2  # expert 1 idle
    want_pairs, want_blocks = triton_moe_routing.align_pairs(ids, num_experts, block_m)
    got_pairs, got_blocks = triton_moe_routing.align_pairs_triton(ids.to(DEVICE), num_experts, block_m)
    assert got_blocks.tolist() == want_blocks.tolist()
    got_rows, want_rows = got_pairs.cpu().view(-1, block_m), want_pairs.view(-1, block_m)
    for expert in set(want_blocks.tolist()):  # each expert's blocks hold the same pairs (in any order)
        mine = want_blocks == expert
        assert sorted(got_rows[mine].flatten().tolist()) == sorted(want_rows[mine].flatten().tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k,block_m,one_launch_align", [
    (1, 2, None, True), (19, 2, 16, True), (9, 3, 32, False)])  # None: the default tiles
def test_triton_kernel_matches_torch_reference(triton_fused_moe, monkeypatch, dtype, num_tokens, top_k, block_m,
                                               one_launch_align):
    if not one_launch_align:  # the torch sort that large batches take
        monkeypatch.setattr(triton_fused_moe, "ALIGN_ONE_LAUNCH_MAX_PAIRS", 0)
    x, w13, w2, weights, ids = _inputs(num_tokens, top_k, dtype, seed=num_tokens)
    config = {"BLOCK_M": block_m, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2} if block_m else None
    got = triton_fused_moe.fused_experts_triton(x, w13, w2, weights, ids, config=config)
    want = fused_experts_torch(x, w13, w2, weights, ids)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_triton_kernel_with_experts_on_another_rank(triton_fused_moe):
    x, w13, w2, weights, ids = _inputs(13, 2, torch.float32, seed=5)
    mine = torch.tensor([1, 3, 5], device=DEVICE)  # expert 3 idle: this rank runs two experts
    expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.long, device=DEVICE)
    expert_map[mine] = torch.arange(3, device=DEVICE)
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    got = triton_fused_moe.fused_experts_triton(x, w13[mine], w2[mine], weights, ids, expert_map, config=config)
    want = fused_experts_torch(x, w13[mine], w2[mine], weights, ids, expert_map)
    assert want.abs().sum() > 0 and (want == 0).all(dim=1).any()  # some tokens have no expert here
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _fp8_experts(w: torch.Tensor, block: tuple[int, int] | None):
    """[E, N, K] weights -> (fp8 weights, float32 scales, the dequantized weights computed here):
    per output channel, or per block (N and K padded up to whole blocks)."""
    e, n, k = w.shape
    if block is None:
        scale = w.float().abs().amax(dim=-1) / 448.0
        q = (w.float() / scale[..., None]).to(torch.float8_e4m3fn)
        return q, scale, q.float() * scale[..., None]
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(e, nb * bn, kb * bk, device=w.device)
    padded[:, :n, :k] = w.float()
    tiles = padded.view(e, nb, bn, kb, bk)
    scale = (tiles.abs().amax(dim=(2, 4)) / 448.0).clamp(min=1e-12)
    q = (tiles / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    dq = (q.float() * scale[:, :, None, :, None]).view(e, nb * bn, kb * bk)[:, :n, :k]
    return q.view(e, nb * bn, kb * bk)[:, :n, :k].contiguous(), scale.contiguous(), dq


@pytest.mark.parametrize("block", [None, (8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_experts_match_their_dequantized_weights(triton_fused_moe, dtype, block):
    """fp8 expert weights with per-channel or block scales (a partial last block on K): the torch
    path and the Triton kernel (weights widened in-kernel, scales per column or per k-block) give
    the result of the 16/32-bit path over the weights dequantized here, an idle expert included."""
    x, w13, w2, weights, ids = _inputs(19, 2, dtype, seed=7)
    q13, s13, dq13 = _fp8_experts(w13, block)
    q2, s2, dq2 = _fp8_experts(w2, block)
    scales = ExpertScales(s13, s2, block)
    want = fused_experts_torch(x, dq13.to(dtype), dq2.to(dtype), weights, ids)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(fused_experts_torch(x, q13, q2, weights, ids, scales=scales), want, **tol)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}  # K tile cut to 16
    got = triton_fused_moe.fused_experts_triton(x, q13, q2, weights, ids, config=config, scales=scales)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    with pytest.raises(ValueError, match="need their scales"):
        triton_fused_moe.fused_experts_triton(x, q13, q2, weights, ids, config=config)


def _int4_experts(w: torch.Tensor, group: int, symmetric: bool):
    """[E, N, K] weights -> (canonical words [E, K / 8, N], scales [E, N, K / G], unpacked zero
    points [E, N, K / G] uint8 or None, the dequantized [E, N, K] computed here)."""
    from pagedllm.ops.int4_layout import pack_rows

    e, n, k = w.shape
    g = w.float().view(e, n, k // group, group)
    if symmetric:
        scale, zero = g.abs().amax(-1) / 7.0, torch.full((e, n, k // group), 8.0, device=w.device)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / 15.0
        zero = torch.round(-lo / scale).clamp(0, 15)
    scale = scale.half().float()  # stored in float16, as GPTQ and AWQ store them
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    dq = ((q - zero[..., None]) * scale[..., None]).view(e, n, k)
    words = torch.stack([pack_rows(q[i].reshape(n, k).t().contiguous()) for i in range(e)])
    return words, scale.half(), None if symmetric else zero.to(torch.uint8), dq


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_experts_match_their_dequantized_weights(triton_fused_moe, dtype, symmetric):
    """int4 experts (W4A16, groups of 32 along K, zero points or symmetric): the torch path and the
    Triton kernel (words unpacked in-kernel, the group scale per K tile) give the 16/32-bit path's
    result over the weights dequantized here."""
    g = torch.Generator().manual_seed(3)
    experts, hidden, inter, group = 6, 64, 32, 32
    x = torch.randn(19, hidden, generator=g).to(dtype).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(DEVICE)
    logits = torch.randn(19, experts, generator=g) + torch.tensor([2.0, 0.5, 0.0, -1e4, -0.5, 0.3])
    weights, ids = (t.to(DEVICE) for t in route(logits, 2, renormalize=True))
    q13, s13, z13, dq13 = _int4_experts(w13, group, symmetric)
    q2, s2, z2, dq2 = _int4_experts(w2, group, symmetric)
    scales = ExpertScales(s13, s2, group=group, w13_zeros=z13, w2_zeros=z2)
    want = fused_experts_torch(x, dq13.to(dtype), dq2.to(dtype), weights, ids)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(fused_experts_torch(x, q13, q2, weights, ids, scales=scales), want, **tol)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}  # K tile cut to the group
    got = triton_fused_moe.fused_experts_triton(x, q13, q2, weights, ids, config=config, scales=scales)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_every_int4_tile_of_the_shipped_table_matches_the_dequantized_experts(triton_fused_moe):
    """Each distinct tiling the shipped table gives int4 experts (decode and the prefill buckets the
    sweep wrote), over groups of 128 as real checkpoints have them, with and without zero points (every
    other tiling each): the kernel's result is the 16-bit path's over the dequantized weights."""
    table = read_table(triton_fused_moe.CONFIG_FILE)
    tiles = {json.dumps(c, sort_keys=True): c for key, entry in table.items() if key.endswith(",W=int4")
             for c in entry.values()}
    assert len(tiles) >= 4  # decode and prefill tilings
    g = torch.Generator().manual_seed(5)
    experts, hidden, inter, group, tokens = 6, 256, 128, 128, 40
    x = torch.randn(tokens, hidden, generator=g).to(torch.float16).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in route(torch.randn(tokens, experts, generator=g), 2, renormalize=True))
    cases = []
    for symmetric in (True, False):
        q13, s13, z13, dq13 = _int4_experts(w13, group, symmetric)
        q2, s2, z2, dq2 = _int4_experts(w2, group, symmetric)
        cases.append(((q13, q2), ExpertScales(s13, s2, group=group, w13_zeros=z13, w2_zeros=z2),
                      fused_experts_torch(x, dq13.half(), dq2.half(), weights, ids).float()))
    for i, (name, config) in enumerate(sorted(tiles.items())):  # tiles alternate symmetric / zero points
        (q13, q2), scales, want = cases[i % 2]
        got = triton_fused_moe.fused_experts_triton(x, q13, q2, weights, ids, config=config, scales=scales)
        torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3, msg=lambda m, n=name: f"{n}: {m}")


def test_tile_config_table_lookup(triton_fused_moe, tmp_path, monkeypatch):
    tuned = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
    path = tmp_path / "configs.json"
    path.write_text('{"E=8,H=64,I=32": {"32": %s}}' % str(tuned).replace("'", '"'))
    monkeypatch.setattr(triton_fused_moe, "_config_table", TileTable(str(path)))
    assert triton_fused_moe.get_config(8, 64, 32, 20, 2) == tuned  # 20 tokens: the 32 bucket
    assert triton_fused_moe.get_config(8, 64, 32, 300, 2) == triton_fused_moe.default_config(300, 2, 8)
    assert triton_fused_moe.get_config(16, 64, 32, 20, 2) == triton_fused_moe.default_config(20, 2, 16)


def test_quantized_experts_take_their_formats_tiles(triton_fused_moe, tmp_path, monkeypatch):
    """Each weight format has its own entries (``,W=fp8`` ...); a format or batch bucket without one
    takes the 16-bit experts' tiles of the shape, then the default."""
    bf16, fp8 = ({"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3} for n in (32, 128))
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"E=8,H=64,I=32": {"32": bf16}, "E=8,H=64,I=32,W=fp8": {"1": fp8}}))
    monkeypatch.setattr(triton_fused_moe, "_config_table", TileTable(str(path)))
    assert triton_fused_moe.get_config(8, 64, 32, 1, 2, "fp8") == fp8
    assert triton_fused_moe.get_config(8, 64, 32, 20, 2, "fp8") == bf16  # no fp8 entry at 32: the 16-bit one
    assert triton_fused_moe.get_config(8, 64, 32, 20, 2, "int4") == bf16
    assert triton_fused_moe.get_config(8, 64, 32, 1, 2, "int4") == triton_fused_moe.default_config(1, 2, 8)
    assert triton_fused_moe.get_config(8, 64, 32, 1, 2) == triton_fused_moe.default_config(1, 2, 8)
    formats = [weight_format(s) for s in (
        None, ExpertScales(torch.ones(1), torch.ones(1)), ExpertScales(torch.ones(1), torch.ones(1), block=(8, 16)),
        ExpertScales(torch.ones(1), torch.ones(1), group=32))]
    assert formats == ["", "fp8", "fp8-block", "int4"] == list(WEIGHT_FORMATS)


def test_warm_up_runs_each_batch_sizes_tiles_once(triton_fused_moe, monkeypatch):
    """Start-up runs the kernels once per distinct (tiles, alignment) of the batch buckets that
    forwards of up to max_tokens reach, so no size compiles a kernel in the middle of a run."""
    small, mid, large = ({"BLOCK_M": m, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}
                         for m in (16, 32, 64))
    buckets = triton_fused_moe.BATCH_BUCKETS
    table = {f"E={NUM_EXPERTS},H={HIDDEN},I={INTER}": {
        str(b): small if b <= 16 else mid if b <= 256 else large for b in buckets}}
    monkeypatch.setattr(triton_fused_moe, "_config_table", lambda: table)
    calls = []
    monkeypatch.setattr(triton_fused_moe, "fused_experts_triton",
                        lambda x, w13, w2, weights, ids, expert_map=None, **kw: calls.append((x.shape[0], ids)))
    _, w13, w2, _, _ = _inputs(1, 2, torch.float32)
    triton_fused_moe.warm_up(w13, w2, 2, None, max_tokens=3000)
    # 1: small tiles; 32: mid; 512: large; 3000 (the 4096 bucket): large, the torch alignment (> 4096 pairs).
    assert [t for t, _ in calls] == [1, 32, 512, 3000]
    assert all(ids.shape == (t, 2) and 0 <= ids.min() and ids.max() < NUM_EXPERTS for t, ids in calls)
    calls.clear()
    triton_fused_moe.warm_up(w13, w2, 2, None, max_tokens=100)  # nothing past the 128 bucket
    assert [t for t, _ in calls] == [1, 32]


def test_warm_up_runs_the_kernels(triton_fused_moe):
    _, w13, w2, _, _ = _inputs(1, 2, torch.float32)
    triton_fused_moe.warm_up(w13, w2, 2, None, max_tokens=20)  # the default tiles: one run of 20 tokens


@pytest.mark.parametrize("scoring,renormalize,round_to,num_experts,top_k,dtype", [
    ("softmax", True, None, 6, 2, torch.float32), ("softmax", False, torch.bfloat16, 60, 8, torch.bfloat16),
    ("sigmoid", True, torch.bfloat16, 128, 8, torch.bfloat16), ("sigmoid", False, None, 5, 1, torch.float32)])
def test_one_launch_routing_picks_the_torch_experts(triton_moe_routing, scoring, renormalize, round_to, num_experts,
                                                    top_k, dtype):
    from pagedllm.ops.fused_moe import route_torch

    logits = torch.randn(13, num_experts, generator=torch.Generator().manual_seed(num_experts)).to(dtype)
    weights, ids = triton_moe_routing.route_triton(logits.to(DEVICE), top_k, scoring, renormalize, round_to)
    ref_w, ref_ids = route_torch(logits, top_k, scoring, renormalize)
    if round_to is not None:
        ref_w = ref_w.to(round_to).float()
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    ids = ids.cpu()
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    else:  # bf16 logits tie often, and torch.topk orders ties its own way: the same scores picked
        assert all(len(set(row)) == top_k for row in ids.tolist())
        assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids))
    tol = 1e-6 if round_to is None else 8e-3  # at most one bf16 step apart
    torch.testing.assert_close(weights.cpu(), ref_w, rtol=tol, atol=tol)
    if round_to is not None:
        assert torch.equal(weights.cpu().to(round_to).float(), weights.cpu())


def test_one_launch_routing_breaks_ties_by_the_lowest_expert(triton_moe_routing):
    weights, ids = triton_moe_routing.route_triton(torch.zeros(2, 7, device=DEVICE), 3, renormalize=True)
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(weights.cpu(), torch.full((2, 3), 1 / 3))


def test_nan_router_logits_and_out_of_range_ids_never_address_past_the_experts(triton_moe_routing):
    """NaN logits (a NaN in the hidden states, or the garbage of a launch the compile dry run
    skipped) still route to valid experts, and the alignment drops ids past the expert count:
    no address outside the counts (an illegal access on the GPU) whatever the input."""
    logits = torch.randn(3, 6, device=DEVICE)
    logits[0] = float("nan")
    logits[1, 2] = float("nan")
    _, ids = triton_moe_routing.route_triton(logits, 2, "softmax", True)
    assert ((0 <= ids) & (ids < 6)).all() and ids[0].tolist() == [0, 1]
    bad = torch.tensor([[1, 6], [9, 0]], device=DEVICE)
    for align in (triton_moe_routing.align_pairs, triton_moe_routing.align_pairs_triton):
        sorted_pairs, block_expert = align(bad, num_experts=6, block_m=2)
        kept = sorted(p for p in sorted_pairs.tolist() if p < 4)
        assert kept == [0, 3] and set(block_expert.tolist()) <= {-1, 0, 1}


def test_the_top_k_sum_is_one_float32_sum_rounded_once(triton_fused_moe):
    per_pair = torch.randn(5 * 3, 1500, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = triton_fused_moe.sum_pairs(per_pair.to(DEVICE), 5, 3)
    assert torch.equal(out.cpu(), per_pair.view(5, 3, 1500).float().sum(dim=1).to(torch.bfloat16))
