"""FP8 KV cache in the attention backends: writes are ``saturate(x / scale)`` rounded to nearest
even (bit for bit the same in torch and in the Triton kernel), reads are ``cache x scale``.

Two references: float64 attention over the *dequantized* K/V (what the cache holds: the
backends must match it as closely as over a model-dtype cache, TOL), and over the original K/V
(the quantization error itself, bounded by FP8_TOL). Without CUDA the Triton kernels run in
Triton's interpreter, its fp8 casts made to round as the GPU does (tests/triton_env.py)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.kv_quant import FP8_MAX, dequantize, fake_quantize, quantize
from pagedllm.attention.torch_backend import TorchAttentionBackend
from tests.attention.test_triton_attention import TOL, Batch, make_batch, random_runs, reference
from tests.triton_env import ON_GPU

DEVICE = "cuda" if ON_GPU else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# ||out - ref|| / ||ref|| against the unquantized K/V, for unit-normal K/V with scales that put
# amax near the top of the range (measured: e4m3 0.033-0.043, e5m2 0.063-0.067 on these batches). e4m3 keeps
# 3 mantissa bits (relative step 1/16), e5m2 2 bits (1/8).
FP8_TOL = {E4M3: 0.06, E5M2: 0.12}


def fp8_batch(b: Batch, cache_dtype: torch.dtype, kv_scale: torch.Tensor) -> tuple[Batch, torch.Tensor]:
    """``b`` with its context stored in an fp8 cache (NaN slots as 0), and the batch whose dense
    K/V are what that cache reads back (the dequantized reference's truth)."""
    cache = b.cache.nan_to_num(0.0)
    fp8 = torch.stack([quantize(cache[i], kv_scale[i].to(cache.device), cache_dtype) for i in (0, 1)])
    deq = dataclasses.replace(b, ks=[fake_quantize(k, kv_scale[0], cache_dtype) for k in b.ks],
                              vs=[fake_quantize(v, kv_scale[1], cache_dtype) for v in b.vs])
    return deq, fp8


def metadata(b: Batch, max_query_len: int) -> AttentionMetadata:
    qsl, seq_lens = b.qsl.tolist(), b.seq_lens.tolist()
    return AttentionMetadata(
        num_actual_tokens=b.num_real_tokens, slot_mapping=b.slots, block_tables=b.block_tables, query_start_loc=b.qsl,
        seq_lens=b.seq_lens, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, max_query_len=max_query_len,
        max_seq_len=max(seq_lens))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


def test_quantize_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([1000.0, -1e6, 0.0, 3.0, 17.0, 19.0, float("inf")])
    q = quantize(x, torch.tensor(2.0), E4M3)
    # 1000/2 and -1e6/2 saturate at +-448 (a plain cast gives NaN); 17/2 = 8.5 lies halfway between
    # e4m3's 8 and 9: even mantissa, 8; 19/2 = 9.5 between 9 and 10: 10.
    assert q.float().tolist() == [448.0, -448.0, 0.0, 1.5, 8.0, 10.0, 448.0]
    assert quantize(torch.tensor([1e9]), torch.tensor(1.0), E5M2).float().item() == FP8_MAX[E5M2]
    assert dequantize(q, torch.tensor(2.0), torch.float32).tolist()[:2] == [896.0, -896.0]


@pytest.mark.parametrize("cache_dtype,dtype", [(E4M3, torch.float32), (E5M2, torch.bfloat16), (E4M3, torch.bfloat16)])
def test_torch_backend_reads_the_fp8_cache_dequantized(cache_dtype, dtype):
    """Prefill chunks with and without cached prefixes, decodes, a window: the torch backend over an
    fp8 cache matches attention over the dequantized K/V, and the original within FP8_TOL."""
    rng = random.Random(3)
    runs = [(13, 6), (0, 9), (40, 1), (5, 1), (0, 1), (22, 3)]
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=2, head_dim=32, dtype=dtype, runs=runs, device="cpu")
    kv_scale = torch.tensor([3.5 / 448, 4.0 / 448])  # unit normals: amax ~3.5-4
    deq, cache = fp8_batch(b, cache_dtype, kv_scale)
    for window in (None, 7):
        out = TorchAttentionBackend().forward(b.q, b.k_new, b.v_new, cache.clone(), metadata(b, 9), 0.2,
                                              sliding_window=window, kv_scale=kv_scale)
        got = out[:b.num_real_tokens]
        assert rel_err(got, reference(deq, 0.2, window)) < TOL[dtype]
        assert rel_err(got, reference(b, 0.2, window)) < FP8_TOL[cache_dtype]


def test_torch_backend_writes_quantized_slots_and_needs_scales():
    rng = random.Random(4)
    b = make_batch(rng, block_size=8, num_kv_heads=2, group=1, head_dim=16, dtype=torch.float32,
                   runs=[(0, 5), (3, 1)], num_pad_rows=2, device="cpu")
    kv_scale = torch.tensor([0.01, 0.02])
    _, cache = fp8_batch(b, E4M3, kv_scale)
    before = cache.clone()
    TorchAttentionBackend().forward(b.q, b.k_new, b.v_new, cache, metadata(b, 5), 0.25, kv_scale=kv_scale)
    real = b.slots[:b.num_real_tokens]
    for i, new in enumerate((b.k_new, b.v_new)):
        want = quantize(new[:b.num_real_tokens], kv_scale[i], E4M3)
        assert torch.equal(cache[i].view(-1, 2, 16)[real].view(torch.uint8), want.view(torch.uint8))
    untouched = torch.ones(cache[0].view(-1, 2, 16).shape[0], dtype=torch.bool)
    untouched[real] = False
    after_bytes, before_bytes = (c.view(torch.uint8).view(2, -1, 2, 16) for c in (cache, before))
    assert torch.equal(after_bytes[:, untouched], before_bytes[:, untouched])
    with pytest.raises(ValueError, match="kv_scale"):
        TorchAttentionBackend().forward(b.q, b.k_new, b.v_new, cache, metadata(b, 5), 0.25)


def test_calculate_kv_scales_uses_amax_over_vllm_constants():
    b = make_batch(random.Random(5), block_size=8, num_kv_heads=2, group=1, head_dim=16, dtype=torch.float32,
                   runs=[(0, 7)], device="cpu")
    kv_scale = torch.ones(2)
    md = dataclasses.replace(metadata(b, 7), calculate_kv_scales=True)
    _, cache = fp8_batch(b, E4M3, kv_scale)
    TorchAttentionBackend().forward(b.q, b.k_new, b.v_new, cache, md, 0.25, kv_scale=kv_scale)
    assert kv_scale.tolist() == pytest.approx([b.k_new.abs().max().item() / 200, b.v_new.abs().max().item() / 100])


# ---- Triton kernels -------------------------------------------------------------------------------
# (block_size, kv_heads, group, head_dim, model dtype, cache dtype, kind, window, splits, soft cap)
TRITON_CASES = [
    (16, 2, 2, 64, torch.bfloat16, E4M3, "mixed", None, None, None),
    (8, 1, 4, 32, torch.float16, E5M2, "prefill", 9, None, None),
    (16, 2, 4, 64, torch.bfloat16, E4M3, "decode", None, 3, None),  # split-KV: v_scale on the partials
    (32, 2, 1, 64, torch.float32, E4M3, "mixed", 12, None, None),
    (16, 2, 2, 64, torch.float32, E4M3, "mixed", None, None, 0.5),  # Gemma 2's cap: k_scale inside the tanh
]


@pytest.mark.parametrize("case", range(len(TRITON_CASES)))
def test_triton_kernels_with_fp8_cache_match_dequantized_reference(kernels, case):
    block_size, kvh, group, hd, dtype, cache_dtype, kind, window, splits, cap = TRITON_CASES[case]
    rng = random.Random(300 + case)
    runs = random_runs(rng, kind, max_ctx=600 if ON_GPU else 40, max_chunk=300 if ON_GPU else 20,
                       max_seqs=12 if ON_GPU else 4)
    b = make_batch(rng, block_size=block_size, num_kv_heads=kvh, group=group, head_dim=hd, dtype=dtype, runs=runs,
                   num_pad_seqs=1, num_pad_rows=1)
    kv_scale = torch.tensor([4.0 / 448, 3.0 / 448], device=DEVICE)
    deq, cache = fp8_batch(b, cache_dtype, kv_scale.cpu())
    cache = cache.to(DEVICE)
    kernels.reshape_and_cache(b.k_new, b.v_new, cache, b.slots, kv_scale)
    out = torch.full_like(b.q, float("nan"))
    hint = 1 if kind == "decode" else max(q for _, q in runs)
    kernels.unified_attention(b.q, cache, b.block_tables, b.qsl, b.seq_lens, hd ** -0.5, out, window,
                              max_query_len=hint, num_kv_splits=splits, kv_scale=kv_scale, logits_soft_cap=cap)
    got = out[:b.num_real_tokens]
    assert not got.isnan().any()
    assert rel_err(got, reference(deq, hd ** -0.5, window, cap)) < TOL[dtype]
    assert rel_err(got, reference(b, hd ** -0.5, window, cap)) < FP8_TOL[cache_dtype]


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_triton_reshape_and_cache_writes_what_torch_writes(kernels, cache_dtype):
    """Bit for bit: IEEE division by the scale, saturation, round to nearest even (the values
    include ones past the range and exact halfway points)."""
    gen = torch.Generator().manual_seed(8)
    num_tokens, kvh, hd = 9, 2, 64
    key = (torch.randn(num_tokens, kvh, hd, generator=gen) * 3).to(torch.bfloat16)
    value = (torch.randn(num_tokens, kvh, hd, generator=gen) * 3).to(torch.bfloat16)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 8.5 * 0.02, 9.5 * 0.02])
    kv_scale = torch.tensor([0.02, 0.05])
    slots = torch.tensor([3, 0, 17, -1, 8, 9, 30, 31, 1])
    caches = []
    for write in ("torch", "triton"):
        cache = torch.zeros(2, 4, 8, kvh, hd, dtype=cache_dtype, device="cpu" if write == "torch" else DEVICE)
        if write == "torch":
            from pagedllm.attention.torch_backend import write_to_paged_cache

            keep = slots >= 0
            write_to_paged_cache(key[keep], value[keep], cache, slots[keep], kv_scale)
        else:
            kernels.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE), kv_scale.to(DEVICE))
        caches.append(cache.cpu().view(torch.uint8))
    assert torch.equal(caches[0], caches[1])
    assert caches[0].view(cache_dtype)[0, 0, 3, 0, :2].float().tolist() == [FP8_MAX[cache_dtype], -FP8_MAX[cache_dtype]]


def test_triton_backend_equals_torch_backend_with_fp8_cache(kernels):
    """Same inputs through both backends with an fp8 cache: the same cache bytes after, and
    outputs as close as two bfloat16 computations of the same dequantized attention."""
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    rng = random.Random(9)
    runs = [(13, 6), (0, 9), (40, 1), (5, 1), (0, 1)]
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=2, head_dim=64, dtype=torch.bfloat16, runs=runs)
    kv_scale = torch.tensor([4.0 / 448, 4.0 / 448], device=DEVICE)
    _, cache0 = fp8_batch(b, E4M3, kv_scale.cpu())
    outs, caches = [], []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        cache = cache0.clone().to(DEVICE)
        outs.append(backend.forward(b.q, b.k_new, b.v_new, cache, metadata(b, 9), 0.125, kv_scale=kv_scale))
        caches.append(cache.cpu().view(torch.uint8))
    assert torch.equal(caches[0], caches[1])
    assert rel_err(outs[0][:b.num_real_tokens], outs[1][:b.num_real_tokens].double().cpu()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("calculate", [False, True])
def test_rotary_write_kv_equals_rotary_then_forward_with_an_fp8_cache(kernels, calculate):
    """The Triton backend's fused rotary + KV write against rotary then ``forward``: the same cache
    bytes, output and scales, also on the step that computes the FP8 KV scales (from the rotated
    K/V, so that step takes the two launches)."""
    from pagedllm.attention.triton_backend import TritonAttentionBackend
    from pagedllm.ops.triton_ops import rotary_embedding
    from tests.ops.test_triton_ops import _rope

    b = make_batch(random.Random(5), block_size=16, num_kv_heads=2, group=2, head_dim=64, dtype=torch.bfloat16,
                   runs=[(13, 6), (0, 9), (40, 1)])
    md = dataclasses.replace(metadata(b, 9), calculate_kv_scales=calculate)
    positions = torch.arange(b.q.shape[0], device=DEVICE) * 3
    cos_sin = _rope(64).cos_sin_cache
    backend = TritonAttentionBackend()
    _, cache0 = fp8_batch(b, E4M3, torch.tensor([4.0 / 448, 4.0 / 448]))
    results = []
    for fused in (True, False):
        cache, kv_scale = cache0.clone().to(DEVICE), torch.tensor([4.0 / 448, 4.0 / 448], device=DEVICE)
        if fused:
            q = backend.rotary_write_kv(positions, b.q, b.k_new, b.v_new, cache, md, cos_sin, kv_scale=kv_scale)
            out = backend.attend(q, cache, md, 0.125, kv_scale=kv_scale)
        else:
            q, k = rotary_embedding(positions, b.q, b.k_new, cos_sin)
            out = backend.forward(q, k, b.v_new, cache, md, 0.125, kv_scale=kv_scale)
        results.append((out[:b.num_real_tokens], cache.view(torch.uint8), kv_scale))
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][2], results[1][2])
    assert torch.equal(results[0][0], results[1][0])
    assert (results[0][2] != 4.0 / 448).all() == calculate


def test_float16_dots_over_an_fp8_cache_match_the_bfloat16_dots(kernels, monkeypatch):
    """bfloat16 queries over an fp8 cache run their dots in float16 (PAGEDLLM_FP8_KV_F16_DOTS):
    as close to the dequantized float64 reference as the bfloat16 dots are, or closer; and a query
    past float16's range saturates instead of turning the output into inf / NaN."""
    rng = random.Random(4)
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=2, head_dim=64, dtype=torch.bfloat16,
                   runs=[(30, 1), (7, 1), (0, 5), (50, 1)])
    kv_scale = torch.tensor([4.0 / 448, 4.0 / 448])
    deq, cache = fp8_batch(b, E4M3, kv_scale)
    cache, kv_scale = cache.to(DEVICE), kv_scale.to(DEVICE)
    kernels.reshape_and_cache(b.k_new, b.v_new, cache, b.slots, kv_scale)
    ref = reference(deq, 0.125, None)
    errs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_FP8_KV_F16_DOTS", flag)
        out = torch.zeros_like(b.q)
        kernels.unified_attention(b.q, cache, b.block_tables, b.qsl, b.seq_lens, 0.125, out, kv_scale=kv_scale)
        errs[flag] = rel_err(out[:b.num_real_tokens], ref)
    assert errs["1"] <= max(errs["0"], 1e-3) * 1.5 and errs["1"] < TOL[torch.bfloat16], errs
    monkeypatch.setenv("PAGEDLLM_FP8_KV_F16_DOTS", "1")
    q = b.q.clone()
    q[:, :, 0] = 1e6  # past float16's 65504: saturates in the dots
    out = torch.zeros_like(q)
    kernels.unified_attention(q, cache, b.block_tables, b.qsl, b.seq_lens, 0.125, out, kv_scale=kv_scale)
    assert out[:b.num_real_tokens].isfinite().all()


@pytest.mark.parametrize("cache_dtype,dtype,head_dim", [(E4M3, torch.bfloat16, 64), (E5M2, torch.float16, 40),
                                                     (E4M3, torch.float32, 64)])
def test_fp8_values_read_as_words_equal_the_byte_reads(kernels, monkeypatch, cache_dtype, dtype, head_dim):
    """Wide decode launches over an fp8 cache read V as 32-bit words split into bytes in registers
    (``FP8_WORDS``); forced on for a small batch here, the output is bit for bit the byte path's
    (both widen exactly), and close to the dequantized reference; a padded head dim (40 of 64) too.
    float32 queries keep IEEE dots on the word path (bit for bit on a GPU, where a tf32 dot would
    differ; the interpreter computes both in float32)."""
    rng = random.Random(5)
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=2, head_dim=head_dim, dtype=dtype,
                   runs=[(30, 1), (7, 1), (50, 1), (16, 1)], num_pad_seqs=1)
    kv_scale = torch.tensor([4.0 / 448, 3.0 / 448])
    deq, cache = fp8_batch(b, cache_dtype, kv_scale)
    cache, kv_scale = cache.to(DEVICE), kv_scale.to(DEVICE)
    kernels.reshape_and_cache(b.k_new, b.v_new, cache, b.slots, kv_scale)
    tile_config, outs = kernels._tile_config, {}
    for words in (True, False):
        monkeypatch.setattr(kernels, "_tile_config", lambda *a, w=words, **k: {**tile_config(*a, **k), "FP8_WORDS": w})
        out = torch.zeros_like(b.q)
        kernels.unified_attention(b.q, cache, b.block_tables, b.qsl, b.seq_lens, head_dim ** -0.5, out,
                                  max_query_len=1, num_kv_splits=1, kv_scale=kv_scale)
        outs[words] = out[:b.num_real_tokens]
    assert torch.equal(outs[True], outs[False])
    assert rel_err(outs[True], reference(deq, head_dim ** -0.5, None)) < TOL[dtype]
    # which launches take it: unsplit decodes of WIDE_DECODE_ROWS tokens and more, whole words a row, mma.sync tiles
    assert tile_config(False, True, 2, 128, False, fp8_unsplit=True, wide_decode=True)["FP8_WORDS"]
    for args in ((True, False, 2, 128, False, True, True), (False, True, 2, 128, False, True, False),
                 (False, True, 2, 128, False, False, True), (False, False, 2, 128, False, True, True),
                 (False, True, 2, 66, False, True, True), (False, True, 64, 128, False, True, True)):
        assert not tile_config(*args).get("FP8_WORDS"), args


def test_triton_fp8_cache_needs_scales(kernels):
    b = make_batch(random.Random(0), block_size=8, num_kv_heads=2, group=2, head_dim=64, dtype=torch.bfloat16,
                   runs=[(3, 2)])
    cache = torch.zeros(b.cache.shape, dtype=E4M3, device=DEVICE)
    out = torch.empty_like(b.q)
    with pytest.raises(ValueError, match="kv_scale"):
        kernels.unified_attention(b.q, cache, b.block_tables, b.qsl, b.seq_lens, 0.1, out)
    with pytest.raises(ValueError, match="kv_scale"):
        kernels.reshape_and_cache(b.k_new, b.v_new, cache, b.slots, torch.ones(2, dtype=torch.float16, device=DEVICE))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_a_captured_decode_graph_reads_the_scales_set_after_capture(kernels):
    """The KV write + attention of a decode batch captured with scales 1.0, replayed after the
    scales change in place (calculate_kv_scales after graph capture): the replay uses the new ones."""
    rng = random.Random(12)
    runs = [(rng.randint(1, 200), 1) for _ in range(8)]
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=4, head_dim=128, dtype=torch.bfloat16, runs=runs)
    kv_scale = torch.ones(2, device=DEVICE)
    cache = torch.zeros(b.cache.shape, dtype=E4M3, device=DEVICE)
    out = torch.zeros_like(b.q)

    def step():
        kernels.reshape_and_cache(b.k_new, b.v_new, cache, b.slots, kv_scale)
        kernels.unified_attention(b.q, cache, b.block_tables, b.qsl, b.seq_lens, 128 ** -0.5, out, max_query_len=1,
                                  kv_scale=kv_scale)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    kv_scale.copy_(torch.tensor([4.0 / 448, 3.0 / 448]))
    deq, fp8 = fp8_batch(b, E4M3, kv_scale.cpu())
    cache.copy_(fp8)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out[:b.num_real_tokens], reference(deq, 128 ** -0.5, None)) < TOL[torch.bfloat16]
