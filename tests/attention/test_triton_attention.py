"""The Triton paged-attention kernels against a float64 softmax over the dense K/V, over random
batch compositions (prefill chunks with cached prefixes, decodes, padding sequences and rows,
GQA, sliding windows, block sizes, scrambled block tables). Without CUDA they run in Triton's
interpreter (slow: few, small cases); on a GPU, many more and larger."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend
from tests.triton_env import ON_GPU

DEVICE = "cuda" if ON_GPU else "cpu"
# ||out - ref|| / ||ref|| limits (METHOD.md): fp32 through IEEE dots, half types with fp32 accumulation.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}


@dataclass
class Batch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim], num_tokens >= real tokens
    k_new: torch.Tensor
    v_new: torch.Tensor
    cache: torch.Tensor  # the context's K/V at their slots, NaN everywhere else
    slots: torch.Tensor
    block_tables: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    ks: list  # dense K/V per real sequence: the truth
    vs: list
    q_lens: list
    ctx_lens: list
    num_real_tokens: int


def make_batch(rng: random.Random, *, block_size: int, num_kv_heads: int, group: int, head_dim: int,
               dtype: torch.dtype, runs: list[tuple[int, int]], num_pad_seqs: int = 0, num_pad_rows: int = 0,
               device: str = DEVICE) -> Batch:
    """``runs``: (cached context length, query length) per real sequence. Padding sequences
    (as a CUDA graph's spare rows) get query length 1 and seq_len 1, or both 0; padding rows
    are token rows past the last sequence with slot -1."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ctx_lens, q_lens = [c for c, _ in runs], [q for _, q in runs]
    seq_lens = [c + q for c, q in runs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-contiguous tables
    tables, i = [], 0
    for nb in blocks_per_seq:
        tables.append(perm[i:i + nb])
        i += nb
    spare = perm[i:]
    width = max(blocks_per_seq) + rng.randint(0, 3)
    num_seqs = len(runs) + num_pad_seqs
    block_tables = torch.tensor([spare[0]], dtype=torch.int32).repeat(num_seqs, width)
    for r, t in enumerate(tables):
        block_tables[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
    num_heads = num_kv_heads * group

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    cache[:, spare[0]] = randn(2, block_size, num_kv_heads, head_dim)  # what padding sequences read
    ks = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    vs = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    slots = []
    for r in range(len(runs)):
        pos = torch.arange(seq_lens[r])
        flat = torch.tensor(tables[r])[pos // block_size] * block_size + pos % block_size
        cache[0].view(-1, num_kv_heads, head_dim)[flat[:ctx_lens[r]]] = ks[r][:ctx_lens[r]]
        cache[1].view(-1, num_kv_heads, head_dim)[flat[:ctx_lens[r]]] = vs[r][:ctx_lens[r]]
        slots += flat[ctx_lens[r]:].tolist()
    pad_q_lens = [rng.choice((0, 1)) for _ in range(num_pad_seqs)]
    num_real = sum(q_lens)
    num_tokens = num_real + sum(pad_q_lens) + num_pad_rows
    slots += [-1] * (num_tokens - num_real)
    qsl = [0]
    for ql in q_lens + pad_q_lens:
        qsl.append(qsl[-1] + ql)
    extra = num_tokens - num_real
    k_new = torch.cat([k[c:] for k, c in zip(ks, ctx_lens)] + [randn(extra, num_kv_heads, head_dim)])
    v_new = torch.cat([v[c:] for v, c in zip(vs, ctx_lens)] + [randn(extra, num_kv_heads, head_dim)])
    return Batch(
        q=randn(num_tokens, num_heads, head_dim).to(device), k_new=k_new.to(device), v_new=v_new.to(device),
        cache=cache.to(device), slots=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device), qsl=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens + pad_q_lens, dtype=torch.int32, device=device),
        ks=ks, vs=vs, q_lens=q_lens, ctx_lens=ctx_lens, num_real_tokens=num_real,
    )


def reference(b: Batch, scale: float, window: int | None, soft_cap: float | None = None) -> torch.Tensor:
    """Plain causal softmax attention in float64 over each sequence's dense K/V (scores
    ``tanh(s / cap) * cap`` with a soft cap)."""
    group = b.q.shape[1] // b.ks[0].shape[1]
    outs, start = [], 0
    for k, v, ql, cl in zip(b.ks, b.vs, b.q_lens, b.ctx_lens):
        q = b.q[start:start + ql].double().cpu()
        kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * scale
        if soft_cap is not None:
            s = torch.tanh(s / soft_cap) * soft_cap
        q_pos, k_pos = torch.arange(cl, cl + ql)[:, None], torch.arange(cl + ql)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        outs.append(torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), vv))
        start += ql
    return torch.cat(outs)


def run_kernels(kernels, b: Batch, scale: float, window: int | None, **hints) -> torch.Tensor:
    cache = b.cache.clone()
    kernels.reshape_and_cache(b.k_new, b.v_new, cache, b.slots)
    out = torch.full_like(b.q, float("nan"))  # poison: every real row must be written
    kernels.unified_attention(b.q, cache, b.block_tables, b.qsl, b.seq_lens, scale, out, window, **hints)
    return out


def check(out: torch.Tensor, b: Batch, scale: float, window: int | None, dtype: torch.dtype, what,
          soft_cap: float | None = None) -> float:
    got = out[:b.num_real_tokens].double().cpu()
    assert not got.isnan().any(), f"{what}: real rows left unwritten or NaN"
    ref = reference(b, scale, window, soft_cap)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < TOL[dtype], f"{what}: relative error {rel:.3g} >= {TOL[dtype]:g}"
    return rel


def random_runs(rng: random.Random, kind: str, max_ctx: int, max_chunk: int, max_seqs: int) -> list[tuple[int, int]]:
    runs = []
    for _ in range(rng.randint(1, max_seqs)):
        decode = kind == "decode" or (kind == "mixed" and rng.random() < 0.5)
        if decode:
            runs.append((rng.randint(0, max_ctx), 1))
        else:  # a prefill chunk, with a cached prefix or (a quarter of the time) from scratch
            ctx = 0 if rng.random() < 0.25 else rng.randint(1, max_ctx)
            runs.append((ctx, rng.randint(2, max_chunk)))
    return runs


# (block_size, kv_heads, group, head_dim, dtype, kind, window, hint): hint is the max_query_len
# passed ("true", None, or 1 even when some runs are longer: a hint never changes results).
CPU_CASES = [
    (16, 2, 2, 64, torch.float32, "mixed", None, "true"),
    (8, 1, 4, 128, torch.float32, "decode", None, "true"),  # decode tiles, split-KV by the heuristic
    (32, 2, 1, 64, torch.float16, "prefill", None, "true"),
    (16, 2, 2, 128, torch.float16, "mixed", 7, None),
    (64, 1, 2, 64, torch.bfloat16, "mixed", None, 1),
    (128, 2, 4, 64, torch.float32, "mixed", 20, "true"),
    (8, 4, 1, 32, torch.float32, "prefill", None, None),
    (16, 2, 3, 80, torch.float32, "mixed", None, "true"),  # head group and head_dim not powers of two
    (32, 1, 2, 256, torch.float16, "mixed", 30, "true"),
    (8, 2, 8, 64, torch.bfloat16, "decode", None, "true"),
]
if ON_GPU:
    _all = [(bs, kvh, g, hd, dt, kind, w, hint)
            for bs in (8, 16, 32, 64, 128) for kvh, g in ((1, 1), (2, 2), (8, 4), (4, 8), (2, 3))
            for hd in (64, 128, 256) for dt in (torch.float32, torch.bfloat16, torch.float16)
            for kind in ("mixed", "decode", "prefill") for w in (None, 5, 100) for hint in ("true", None, 1)]
    # Each distinct shape compiles its own kernels (~0.5-1 s each): 30 draws keep the pass short.
    CASES = CPU_CASES + random.Random(0).sample(_all, 30)
else:
    CASES = CPU_CASES


@pytest.mark.parametrize("case", range(len(CASES)))
def test_unified_attention_matches_float64_softmax(kernels, case):
    block_size, kvh, group, hd, dtype, kind, window, hint = CASES[case]
    rng = random.Random(case)
    for trial in range(4 if ON_GPU else 1):
        runs = random_runs(rng, kind, max_ctx=600 if ON_GPU else 40, max_chunk=300 if ON_GPU else 20,
                           max_seqs=12 if ON_GPU else 4)
        b = make_batch(rng, block_size=block_size, num_kv_heads=kvh, group=group, head_dim=hd, dtype=dtype,
                       runs=runs, num_pad_seqs=rng.randint(0, 2), num_pad_rows=rng.randint(0, 2))
        max_q = {"true": max(q for _, q in runs), None: None, 1: 1}[hint]
        scale = hd ** -0.5
        out = run_kernels(kernels, b, scale, window, max_query_len=max_q)
        check(out, b, scale, window, dtype, (CASES[case], runs))
        # Rows past the last sequence belong to no one: left as they were.
        assert out[b.qsl[-1].item():].isnan().all()


@pytest.fixture(params=["own", "kernel"])
def merge(request, kernels, monkeypatch):
    """How split launches merge: in their own last programs, or in the merge kernel after them."""
    own = request.param == "own"
    monkeypatch.setattr(kernels, "SELF_MERGE_MIN_ROWS", 0 if own else 10 ** 9)
    monkeypatch.setattr(kernels, "SPLIT_MIN_KEYS", 1)  # every forced part runs (by context: next test)
    launches = []
    real = kernels._merge_splits
    monkeypatch.setattr(kernels, "_merge_splits", lambda *a, **k: launches.append(1) or real(*a, **k))
    return own, launches


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 8, 16])
def test_decode_split_kv_matches_reference(kernels, splits, merge):
    """Forced split counts, any count up to MAX_SPLITS (the heuristic's choice depends on the
    GPU): contexts longer than one split, shorter than the number of splits (empty splits),
    and zero (nothing cached); merged either way."""
    rng = random.Random(splits)
    runs = [(0, 1), (3, 1), (rng.randint(70, 120), 1), (rng.randint(20, 60), 1)]
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=4, head_dim=64, dtype=torch.float32, runs=runs,
                   num_pad_seqs=2)
    out = run_kernels(kernels, b, 0.125, None, max_query_len=1, num_kv_splits=splits)
    check(out, b, 0.125, None, torch.float32, splits)
    out = run_kernels(kernels, b, 0.125, 9, max_query_len=1, num_kv_splits=splits)
    check(out, b, 0.125, 9, torch.float32, (splits, "window 9"))
    assert_merged(out.device, splits, merge)


@pytest.mark.parametrize("window", [None, 40])
def test_self_merging_splits_follow_each_rows_context(kernels, monkeypatch, window):
    """A launch that merges itself splits each row into at most the launch's parts of SPLIT_MIN_KEYS
    keys or more (here 2 tiles of 16): a short context writes its row directly (no partial stored), a
    longer one uses as many parts as its keys fill, and the parts past its count store nothing."""
    monkeypatch.setattr(kernels, "SELF_MERGE_MIN_ROWS", 0)
    monkeypatch.setattr(kernels, "SPLIT_MIN_KEYS", 32)
    buffers = []
    real = kernels._split_buffers

    def poisoned(*a):  # NaN everywhere: what a program stores is what is not NaN afterwards
        buffers.append(tuple(t.fill_(float("nan")) for t in real(*a)))
        return buffers[-1]

    monkeypatch.setattr(kernels, "_split_buffers", poisoned)
    rng = random.Random(11)
    contexts = [0, 30, 31, 63, 64, 95, 150, 260]  # + this step's token: 1, 31, 32, 64, 65, 96, 151, 261 keys
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32,
                   runs=[(c, 1) for c in contexts], num_pad_seqs=1)
    out = run_kernels(kernels, b, 0.125, window, max_query_len=1, num_kv_splits=4)
    check(out, b, 0.125, window, torch.float32, window)
    (part_out, part_m, part_l), = buffers
    for row, ctx in enumerate(contexts):
        keys = ctx + 1 if window is None else min(ctx + 1, window)
        first_tile = 0 if window is None else max(ctx - window + 1, 0) // 16
        tiles = -(-(ctx + 1) // 16) - first_tile
        parts = max(1, min(4, tiles // 2))
        stored = ~part_m[row].isnan()  # [heads, 4]
        want = torch.arange(4) < parts if parts > 1 else torch.zeros(4, dtype=torch.bool)
        assert (stored == want.to(stored.device)).all(), (row, ctx, keys, stored)
    assert_no_count_left(out.device)


def assert_no_count_left(device):
    from pagedllm.ops import triton_splitk

    counters = triton_splitk._COUNTERS.get((device, "attention"))
    assert counters is None or not counters.any()


def assert_merged(device, splits, merge):
    """Split launches merged as ``merge`` says; those that merged themselves reset their counters
    (the last split of each program row): all zero again."""
    from pagedllm.ops import triton_splitk

    own, launches = merge
    if splits == 1:
        assert launches == []
        return
    assert (launches == []) == own, launches
    assert (device, "attention") in triton_splitk._COUNTERS or not own
    assert_no_count_left(device)


def test_split_kv_handles_multi_token_runs(kernels):
    """The split path is picked by a hint; a wrong hint (prefill chunks present) stays correct."""
    rng = random.Random(5)
    runs = [(12, 9), (0, 5), (30, 1)]
    b = make_batch(rng, block_size=8, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32, runs=runs,
                   num_pad_rows=3)
    for hint in (1, None):
        out = run_kernels(kernels, b, 0.125, None, max_query_len=hint, num_kv_splits=4)
        check(out, b, 0.125, None, torch.float32, hint)


# (block_size, kv_heads, group, head_dim, dtype, kind, window, splits, soft cap): the capped variant
# over prefill + decode launches, with and without a window, and the split-KV decode path.
SOFT_CAP_CASES = [
    (16, 2, 2, 64, torch.float32, "mixed", None, None, 5.0),
    (8, 1, 4, 32, torch.float32, "mixed", 6, None, 2.0),
    (16, 2, 2, 64, torch.float32, "decode", 9, 3, 3.0),
    (32, 2, 2, 64, torch.bfloat16, "mixed", 12, None, 8.0),
]


@pytest.mark.parametrize("case", range(len(SOFT_CAP_CASES)))
def test_logits_soft_cap_matches_float64_reference(kernels, case):
    """Scores ``tanh(s / cap) * cap`` before masking and softmax (Gemma 2); small caps so the cap
    changes the result (checked: the uncapped reference is far off)."""
    block_size, kvh, group, hd, dtype, kind, window, splits, cap = SOFT_CAP_CASES[case]
    rng = random.Random(100 + case)
    runs = random_runs(rng, kind, max_ctx=40, max_chunk=20, max_seqs=4)
    b = make_batch(rng, block_size=block_size, num_kv_heads=kvh, group=group, head_dim=hd, dtype=dtype, runs=runs,
                   num_pad_seqs=1, num_pad_rows=1)
    scale = 1.0  # larger scores than hd ** -0.5 gives, so the cap bites
    hint = 1 if kind == "decode" else max(q for _, q in runs)
    out = run_kernels(kernels, b, scale, window, max_query_len=hint, num_kv_splits=splits, logits_soft_cap=cap)
    check(out, b, scale, window, dtype, SOFT_CAP_CASES[case], soft_cap=cap)
    uncapped = reference(b, scale, window)
    got = out[:b.num_real_tokens].double().cpu()
    assert ((got - uncapped).norm() / uncapped.norm()).item() > 10 * TOL[dtype]


def test_torch_backend_soft_cap_matches_reference():
    """The CPU reference backend's capped path (prefill with a cached prefix, decodes) against the
    same float64 reference."""
    rng = random.Random(21)
    runs = [(13, 6), (0, 9), (40, 1), (5, 1)]
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32, runs=runs,
                   device="cpu")
    b.cache.nan_to_num_(0.0)
    qsl, seq_lens = b.qsl.tolist(), b.seq_lens.tolist()
    md = AttentionMetadata(
        num_actual_tokens=b.num_real_tokens, slot_mapping=b.slots, block_tables=b.block_tables,
        query_start_loc=b.qsl, seq_lens=b.seq_lens, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        max_query_len=9, max_seq_len=max(seq_lens))
    for window in (None, 7):
        out = TorchAttentionBackend().forward(b.q, b.k_new, b.v_new, b.cache.clone(), md, 1.0,
                                              sliding_window=window, logits_soft_cap=4.0)
        check(out, b, 1.0, window, torch.float32, window, soft_cap=4.0)


def test_padding_sequences_do_not_disturb_real_rows(kernels):
    """A CUDA graph's spare rows: sequences of query length 1 and seq_len 1, or both 0, and
    token rows of no sequence. Real rows stay exact; no NaN reaches them."""
    rng = random.Random(11)
    runs = [(25, 1), (0, 1), (7, 1)]
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32, runs=runs,
                   num_pad_seqs=4, num_pad_rows=2)
    b.seq_lens[len(runs):] = b.qsl[len(runs) + 1:] - b.qsl[len(runs):-1]  # 1 where the query length is 1, else 0
    for splits in (1, 4):
        out = run_kernels(kernels, b, 0.125, None, max_query_len=1, num_kv_splits=splits)
        check(out, b, 0.125, None, torch.float32, splits)
        end = b.qsl[-1].item()
        assert not out[b.num_real_tokens:end].isnan().any()  # padding sequences: finite
        assert out[end:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_exactly_the_mapped_slots(kernels, dtype):
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kvh, hd, num_tokens = 7, 8, 2, 64, 12
    cache = torch.randn(2, num_blocks, block_size, kvh, hd, generator=gen).to(dtype).to(DEVICE)
    before = cache.clone()
    # K and V as the model hands them over: strided views into one fused projection.
    qkv = torch.randn(num_tokens, (4 + 2 * kvh) * hd, generator=gen).to(dtype).to(DEVICE)
    key = qkv[:, 4 * hd:(4 + kvh) * hd].view(num_tokens, kvh, hd)
    value = qkv[:, (4 + kvh) * hd:].view(num_tokens, kvh, hd)
    slots = rng.sample(range(num_blocks * block_size), num_tokens)
    for t in rng.sample(range(num_tokens), 4):
        slots[t] = -1
    kernels.reshape_and_cache(key, value, cache, torch.tensor(slots, device=DEVICE))
    expect = before.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            expect[0].view(-1, kvh, hd)[s] = key[t]
            expect[1].view(-1, kvh, hd)[s] = value[t]
    assert torch.equal(cache, expect)


@pytest.mark.parametrize("long_decode", [False, True])
def test_backend_forward_equals_torch_backend(kernels, monkeypatch, long_decode):
    """Same inputs through both backends: same attention output and the same cache after. With a
    decode over 2,100 and one over 2,200 keys beside the chunks, the backend's host facts split the
    decodes' launch in two."""
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    splits = []  # (partial rows, splits) of each split launch
    real = kernels._split_buffers
    monkeypatch.setattr(kernels, "_split_buffers", lambda rows, heads, n, *a: splits.append((rows, n)) or
                        real(rows, heads, n, *a))
    rng = random.Random(7)
    runs = [(30, 12), (2100, 1), (0, 9), (2200, 1)] if long_decode else [(13, 6), (0, 9), (40, 1), (5, 1), (0, 1)]
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32, runs=runs)
    b.cache.nan_to_num_(0.0)  # the torch backend's gather reads whole blocks (masked later)
    qsl, seq_lens = b.qsl.tolist(), b.seq_lens.tolist()
    md = AttentionMetadata(
        num_actual_tokens=b.num_real_tokens, slot_mapping=b.slots, block_tables=b.block_tables,
        query_start_loc=b.qsl, seq_lens=b.seq_lens, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        max_query_len=max(q for _, q in runs), max_seq_len=max(seq_lens))
    outs, caches = [], []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        cache = b.cache.clone()
        outs.append(backend.forward(b.q, b.k_new, b.v_new, cache, md, 0.125, sliding_window=None))
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    rel = ((outs[0] - outs[1]).double().norm() / outs[1].double().norm()).item()
    assert rel < 1e-5, rel
    # partials by sequence (4 sequences x the short tile's rows), the decodes' keys in two parts
    assert splits == ([(4 * kernels.short_run_tokens(4, 2), 2)] if long_decode else [])


def test_bad_arguments_are_rejected(kernels):
    b = make_batch(random.Random(0), block_size=8, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32,
                   runs=[(3, 2)])
    out = torch.empty_like(b.q)
    with pytest.raises(ValueError, match="sliding_window"):
        kernels.unified_attention(b.q, b.cache, b.block_tables, b.qsl, b.seq_lens, 0.1, out, 0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        kernels.unified_attention(b.q, b.cache, b.block_tables, b.qsl, b.seq_lens, 0.1, out, logits_soft_cap=0.0)
    with pytest.raises(ValueError, match="multiple"):
        kernels.unified_attention(b.q[:, :3], b.cache, b.block_tables, b.qsl, b.seq_lens, 0.1, out[:, :3])
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.reshape_and_cache(b.k_new, b.v_new, b.cache, b.slots[:1])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
# split-KV by the heuristic at every size on 132-SM GPUs: 4 and 16 sequences (few programs; 16 x 2 KV heads merge in
# their own last programs), 128 (256 programs: two parts, each row by its own context; up to 1,200 keys some rows
# take both parts, within the graph)
@pytest.mark.parametrize("max_seqs,max_ctx", [(4, 200), (16, 200), (128, 200), (128, 1200)])
def test_decode_step_replays_in_a_cuda_graph_with_new_metadata(kernels, max_seqs, max_ctx):
    """Capture the KV write + attention of a padded decode batch once, then replay it over new
    batches written into the same buffers: different sequence counts, contexts and tables. Split
    launches that merge themselves leave their counters at zero after every replay."""
    rng = random.Random(max_seqs + max_ctx)
    block_size, kvh, group, hd, dtype = 16, 2, 4, 128, torch.bfloat16
    width, num_blocks = max_ctx // block_size + 8, max(1700, max_seqs * (max_ctx // block_size + 2) + 8)
    q = torch.zeros(max_seqs, kvh * group, hd, dtype=dtype, device=DEVICE)
    k_new, v_new = torch.zeros(max_seqs, kvh, hd, dtype=dtype, device=DEVICE), torch.zeros(
        max_seqs, kvh, hd, dtype=dtype, device=DEVICE)
    slots = torch.full((max_seqs,), -1, dtype=torch.int64, device=DEVICE)
    block_tables = torch.zeros(max_seqs, width, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(max_seqs + 1, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.ones(max_seqs, dtype=torch.int32, device=DEVICE)
    cache = torch.zeros(2, num_blocks, block_size, kvh, hd, dtype=dtype, device=DEVICE)
    out = torch.zeros_like(q)

    def step():
        kernels.reshape_and_cache(k_new, v_new, cache, slots)
        kernels.unified_attention(q, cache, block_tables, qsl, seq_lens, hd ** -0.5, out, max_query_len=1)

    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(3):
        n = rng.randint(1, max_seqs)
        b = make_batch(rng, block_size=block_size, num_kv_heads=kvh, group=group, head_dim=hd, dtype=dtype,
                       runs=[(rng.randint(0, max_ctx), 1) for _ in range(n)])
        assert b.cache.shape[1] <= num_blocks and b.block_tables.shape[1] <= width
        cache.zero_()
        cache[:, :b.cache.shape[1]] = b.cache.nan_to_num(0.0)
        block_tables.zero_()
        block_tables[:n, :b.block_tables.shape[1]] = b.block_tables
        seq_lens.fill_(1)  # padding rows: one token of context, nothing written
        seq_lens[:n] = b.seq_lens
        slots.fill_(-1)
        slots[:n] = b.slots
        q[:n], k_new[:n], v_new[:n] = b.q, b.k_new, b.v_new
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, b, hd ** -0.5, None, dtype, (max_seqs, trial, n))
        assert_no_count_left(out.device)


def test_wide_decode_batches_match_reference(kernels):
    """A decode launch of WIDE_DECODE_ROWS tokens or more over a 16-bit cache takes 64-key tiles
    with 2 stages (not split): contexts that end inside, at and past a key tile, plus padding."""
    assert kernels._tile_config(False, True, 2, 64, False, wide_decode=True)["BLOCK_N"] == 64  # the path under test
    rng = random.Random(7)
    n = kernels.WIDE_DECODE_ROWS + 3
    runs = [(rng.choice([0, 1, 63, 64, 65, rng.randint(2, 140)]), 1) for _ in range(n)]
    b = make_batch(rng, block_size=16, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float16, runs=runs,
                   num_pad_seqs=1)
    out = run_kernels(kernels, b, 0.125, None, max_query_len=1, num_kv_splits=1)
    check(out, b, 0.125, None, torch.float16, "wide decode")


@pytest.mark.parametrize("splits", [None, 2, 5])
def test_mixed_step_decodes_split_over_their_keys(kernels, splits, merge):
    """A step of prefill chunks with decodes (and a 3-token run, short too) beside them: the short runs'
    launch split over keys (partials by sequence, merged for short runs only), from the host facts
    (``short_runs``) or forced; every row matches the float64 softmax, the chunks' rows included, and
    a wrong host hint changes nothing but the split count."""
    rng = random.Random(31)
    runs = [(rng.randint(40, 90), 1), (0, 23), (57, 1), (rng.randint(30, 60), 3), (12, 19), (0, 1)]
    b = make_batch(rng, block_size=8, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32, runs=runs,
                   num_pad_seqs=1, num_pad_rows=2)
    qsl, lens = b.qsl.tolist(), b.seq_lens.tolist()
    short = kernels.count_short_runs(qsl, lens, kernels.short_run_tokens(4, 2))
    assert short == (4, sum(c + q for c, q in runs if q <= 8))
    assert kernels.count_short_runs(qsl, lens, 8, sliding_window=20) == (4, sum(min(c + q, 20 + q) for c, q in runs
                                                                                if q <= 8))
    for hint in (short, (1, 10 ** 6)):
        out = run_kernels(kernels, b, 0.125, None, max_query_len=23, num_kv_splits=splits, short_runs=hint)
        check(out, b, 0.125, None, torch.float32, (splits, hint))
        assert out[b.qsl[-1].item():].isnan().all()
    assert_merged(out.device, splits, merge)


def test_mixed_split_counts():
    """Parts of MIXED_SPLIT_KEYS keys or more until the short runs' programs fill the SMs
    MIXED_SPLIT_WAVES times; none without short runs; one when the host facts are unknown."""
    from pagedllm.attention import triton_kernels as tk
    cpu = torch.device("cpu")  # the interpreter's 132 SMs
    assert tk._mixed_splits(None, 8, cpu) == 1 and tk._mixed_splits((0, 0), 8, cpu) == 0
    assert tk._mixed_splits((4, 4 * 6000), 8, cpu) == 5  # 6k keys each: parts of >= 1,024
    assert tk._mixed_splits((40, 40 * 6000), 8, cpu) == 2  # 320 programs: 2 fill 528
    assert tk._mixed_splits((200, 200 * 6000), 8, cpu) == 1
    assert tk._mixed_splits((2, 2 * 500), 8, cpu) == 1  # short contexts stay whole
    assert tk._mixed_splits((1, 10 ** 6), 1, cpu) == tk.MAX_SPLITS
