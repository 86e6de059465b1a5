"""The Triton ops compute what the torch code of pagedllm.model.layers computes: on random
inputs of odd sizes, in float32, bfloat16 and float16, on the strided q/k views a fused qkv
projection gives, with every output element written (outputs are poisoned with NaN first).
Errors are ‖out − ref‖ / ‖ref‖ against the torch layer in the same dtype and against a
float64 evaluation of the same formula."""
from __future__ import annotations

import types

import pytest
import torch

import pagedllm.ops
from pagedllm.model import layers
from tests.ops.conftest import DEVICE

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# ‖out − ref‖/‖ref‖ bounds. Against float64: the output's own rounding. Against the torch layer
# in the same dtype the kernels round where it rounds, so only rare one-ulp flips may differ
# (fp32 summation order, the hardware's rsqrt/exp): about 1% of the elements at most; rounding
# once where torch rounds twice flips far more and fails.
TOL_FP64 = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
TOL_SAME = {torch.float32: 1e-6, torch.bfloat16: 3e-4, torch.float16: 6e-5}
if torch.cuda.is_available():  # the GPU's fp32 rsqrt/exp/FMA contraction flip more last bits (seen: 2e-3 bf16)
    TOL_SAME = {torch.float32: 2e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}


@pytest.fixture(autouse=True)
def torch_reference(monkeypatch):
    """The layers run their torch code (the reference), on CUDA too."""
    monkeypatch.setattr(layers, "triton_ops_for", lambda x: None)


@pytest.fixture
def ops(triton_ops, monkeypatch):
    """The Triton ops, with every float tensor torch.empty makes filled with NaN first."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    return triton_ops


def _rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(device=DEVICE, dtype=dtype)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and not out.isnan().any(), "unwritten (NaN) output elements"
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _check(out, ref_same, ref64):
    assert out.dtype == ref_same.dtype and out.is_contiguous()
    assert _rel(out, ref_same) <= TOL_SAME[out.dtype], "differs from the torch layer"
    assert _rel(out, ref64) <= TOL_FP64[out.dtype], "differs from the float64 formula"


def _rms_norm64(x, weight, eps):
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _qkv_views(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype):
    """q, k as llama.py makes them: views of one [T, (Hq + 2 Hk) D] projection output."""
    qkv = _rand(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.view(-1, num_q_heads, head_dim), k.view(-1, num_kv_heads, head_dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    return q, k


def _norm_layer(hidden, dtype, eps=1e-5):
    norm = layers.RMSNorm(hidden, eps)
    norm.weight.data = _rand(hidden, dtype=dtype, scale=0.5) + 1
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 200), (3, 5, 96), (1, 4096), (33,)])
def test_rms_norm_matches_the_torch_layer(ops, dtype, shape):
    norm = _norm_layer(shape[-1], dtype)
    x = _rand(*shape, dtype=dtype, scale=3.0)
    out = ops.rms_norm(x, norm.weight, norm.eps)
    _check(out, norm(x), _rms_norm64(x, norm.weight, norm.eps))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantizes_its_rows_as_the_fp8_quantize_kernel_does(ops, triton_fp8, dtype, with_residual):
    """fp8_out (an fp8 W8A8 projection next): the norm's output unchanged, and attached to it the
    per-token fp8 rows and scales ``quantize_fp8`` makes of that output, bit for bit (a zero row
    takes the floor scale); taken once, stale once the output changes in place; none for float32."""
    norm = _norm_layer(300, dtype)
    x = _rand(5, 300, dtype=dtype, scale=3.0)
    x[2] = 0
    if with_residual:
        residual = _rand(5, 300, dtype=dtype)
        residual[2] = 0
        out, _ = ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps, fp8_out=True)
        plain, _ = ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    else:
        out, plain = ops.rms_norm(x, norm.weight, norm.eps, fp8_out=True), ops.rms_norm(x, norm.weight, norm.eps)
    assert torch.equal(out, plain) and ops.attached_fp8(plain) is None
    q, scales = ops.attached_fp8(out)
    want_q, want_scales = triton_fp8.quantize_fp8(out)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)
    assert float(scales[2]) == pytest.approx(1.0 / (448.0 * 512.0))
    assert ops.attached_fp8(out) is None  # taken once
    stale = ops.rms_norm(x, norm.weight, norm.eps, fp8_out=True)
    stale.mul_(2)
    assert ops.attached_fp8(stale) is None
    with torch.inference_mode():  # as the engine runs: no version counter, still handed over
        assert ops.attached_fp8(ops.rms_norm(x, norm.weight, norm.eps, fp8_out=True)) is not None
    assert ops.attached_fp8(ops.rms_norm(x.float(), norm.weight.float(), norm.eps, fp8_out=True)) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_adds_in_the_model_dtype_then_norms(ops, dtype):
    norm = _norm_layer(257, dtype, eps=1e-6)
    x, residual = _rand(13, 257, dtype=dtype), _rand(13, 257, dtype=dtype, scale=4.0)
    out, new_residual = ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    ref_out, ref_residual = norm(x, residual)
    assert new_residual.dtype == dtype and torch.equal(new_residual, ref_residual)  # the same rounding
    _check(out, ref_out, _rms_norm64(ref_residual, norm.weight, norm.eps))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_qk_views_normalises_each_head(ops, dtype):
    """Qwen3's q_norm/k_norm: rows are T x H heads of a non-contiguous [T, H, D] view."""
    q, k = _qkv_views(9, 6, 2, 64, dtype)
    norm = _norm_layer(64, dtype, eps=1e-6)
    for x in (q, k):
        out = ops.rms_norm(x, norm.weight, norm.eps)
        _check(out, norm(x.contiguous()), _rms_norm64(x, norm.weight, norm.eps))
    # and through the residual path, with a strided residual too
    out, new_residual = ops.fused_add_rms_norm(q, q.flip(0), norm.weight, norm.eps)
    ref_out, ref_residual = norm(q.contiguous(), q.flip(0).contiguous())
    assert torch.equal(new_residual, ref_residual)
    _check(out, ref_out, _rms_norm64(ref_residual, norm.weight, norm.eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 173), (2, 2 * 1500), (1, 2 * 64)])
def test_silu_and_mul_matches_the_torch_layer(ops, dtype, shape):
    x = _rand(*shape, dtype=dtype, scale=3.0)
    out = ops.silu_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    _check(out, layers.SiluAndMul()(x), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_quantizes_its_rows_as_the_fp8_quantize_kernel_does(ops, triton_fp8, dtype):
    """fp8_out (an fp8 down_proj next): the output unchanged (whole-row programs instead of
    column blocks), and attached its per-token fp8 rows and scales, bit for bit as ``quantize_fp8``."""
    x = _rand(4, 2 * 1500, dtype=dtype, scale=3.0)
    x[1] = 0
    out = ops.silu_and_mul(x, fp8_out=True)
    assert torch.equal(out, ops.silu_and_mul(x))
    q, scales = ops.attached_fp8(out)
    want_q, want_scales = triton_fp8.quantize_fp8(out)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)
    assert ops.attached_fp8(ops.silu_and_mul(x.float(), fp8_out=True)) is None  # float32: not quantized


def _rope(head_dim, rope_scaling=None):
    config = types.SimpleNamespace(rope_theta=5e5, rope_scaling=rope_scaling)
    return layers.RotaryEmbedding(head_dim, 4096, config).to(DEVICE)


def _rotate64(x, cos_sin):
    cos, sin = cos_sin.double().unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,scaling", [((8, 2), 128, LLAMA3_SCALING), ((4, 4), 64, None),
                                                    ((3, 1), 96, None), ((16, 8), 128, None)])
def test_rotary_of_q_and_k_views_matches_the_torch_layer(ops, dtype, heads, head_dim, scaling):
    num_tokens = 11
    q, k = _qkv_views(num_tokens, *heads, head_dim, dtype)
    rope = _rope(head_dim, scaling)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    q_out, k_out = ops.rotary_embedding(positions, q, k, rope.cos_sin_cache)
    q_ref, k_ref = rope(positions, q, k)
    cos_sin = rope.cos_sin_cache[positions]
    _check(q_out, q_ref, _rotate64(q, cos_sin))
    _check(k_out, k_ref, _rotate64(k, cos_sin))


def test_rotary_with_int32_positions_and_contiguous_inputs(ops):
    q, k = _rand(6, 4, 64, dtype=torch.float32), _rand(6, 2, 64, dtype=torch.float32)
    rope = _rope(64)
    positions = torch.tensor([0, 1, 2, 100, 4095, 7], dtype=torch.int32, device=DEVICE)
    q_out, k_out = ops.rotary_embedding(positions, q, k, rope.cos_sin_cache)
    q_ref, k_ref = rope(positions.long(), q, k)
    assert torch.allclose(q_out, q_ref, rtol=1e-5, atol=1e-6) and torch.allclose(k_out, k_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(q_out[0], q[0]) and torch.equal(k_out[0], k[0])  # position 0 is the identity


def test_empty_batches_and_bad_shapes(ops):
    w = torch.ones(8, device=DEVICE)
    assert ops.rms_norm(torch.empty(0, 8, device=DEVICE), w, 1e-6).shape == (0, 8)
    assert ops.silu_and_mul(torch.empty(0, 16, device=DEVICE)).shape == (0, 8)
    with pytest.raises(ValueError, match="residual must match x"):
        ops.fused_add_rms_norm(torch.ones(2, 8, device=DEVICE), torch.ones(2, 8, device=DEVICE).half(), w, 1e-6)
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul(torch.ones(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="weight has shape"):
        ops.rms_norm(torch.ones(2, 8, device=DEVICE), torch.ones(9, device=DEVICE), 1e-6)


def test_triton_ops_are_picked_only_for_cuda_tensors_unless_disabled(triton_ops, monkeypatch):
    cuda_like = types.SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(pagedllm.ops, "_TRITON_OPS", None)
    assert pagedllm.ops.triton_ops_for(cuda_like) is triton_ops
    assert pagedllm.ops.triton_ops_for(torch.ones(1)) is None  # CPU tensors: the torch code
    monkeypatch.setattr(pagedllm.ops, "_TRITON_OPS", None)
    monkeypatch.setenv(pagedllm.ops.DISABLE_ENV, "1")
    assert pagedllm.ops.triton_ops_for(cuda_like) is None


def test_a_model_through_the_triton_ops_gives_the_torch_layers_greedy_tokens(triton_ops, monkeypatch, tmp_path):
    """Qwen3 (q/k norm on strided views, rotary, fused add-norm, SiLU-and-mul) in float32: the
    layers dispatched to the Triton ops (here on whatever device the test runs) against torch."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams, TokensPrompt
    from tests.conftest import TEST_KV_BYTES, _tiny_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_tiny_config("qwen3", vocab_size=1024)).save_pretrained(tmp_path)
    model = str(tmp_path)
    prompts = [TokensPrompt(prompt_token_ids=[5, 17, 300, 42, 9, 1000, 77]), TokensPrompt(prompt_token_ids=[3, 8])]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, detokenize=False)
    llm = LLM(model, dtype="float32", device=DEVICE, kv_cache_memory_bytes=TEST_KV_BYTES, enforce_eager=True,
              skip_tokenizer_init=True)
    ref = llm.generate(prompts, params, use_tqdm=False)
    calls = []
    monkeypatch.setattr(layers, "triton_ops_for", lambda x: calls.append(x.shape) or triton_ops)
    fast = llm.generate(prompts, params, use_tqdm=False)
    assert any(len(shape) == 3 for shape in calls), "the q/k norms and rotary ([T, H, D]) did not dispatch"
    for r, f in zip(ref, fast):
        assert f.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lf in zip(r.outputs[0].logprobs, f.outputs[0].logprobs):
            (tok, ref_lp), = lr.items()
            assert lf[tok].logprob == pytest.approx(ref_lp.logprob, abs=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [((16, 8), 128), ((3, 1), 64)])
def test_qk_norm_rotary_equals_norms_then_rotary(ops, dtype, heads, head_dim):
    """Qwen3's q/k RMSNorm + rotary in one launch: the torch layers' values, in one kernel."""
    num_tokens = 9
    q, k = _qkv_views(num_tokens, *heads, head_dim, dtype)
    rope = _rope(head_dim)
    q_norm, k_norm = layers.RMSNorm(head_dim, 1e-6).to(DEVICE, dtype), layers.RMSNorm(head_dim, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        q_norm.weight.copy_(_rand(head_dim, dtype=dtype) + 1)
        k_norm.weight.copy_(_rand(head_dim, dtype=dtype) + 1)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    q_out, k_out = ops.qk_norm_rotary(positions, q, k, q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin_cache)
    q_ref, k_ref = rope(positions, q_norm(q), k_norm(k))
    cos_sin = rope.cos_sin_cache[positions]

    def norm64(x, w):
        x = x.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()

    _check(q_out, q_ref, _rotate64(norm64(q, q_norm.weight), cos_sin))
    _check(k_out, k_ref, _rotate64(norm64(k, k_norm.weight), cos_sin))


@pytest.mark.parametrize("dtype,cache_dtype,norm", [
    (torch.float32, None, False), (torch.bfloat16, None, True),
    (torch.bfloat16, torch.float8_e4m3fn, False), (torch.float16, torch.float8_e5m2, True)])
def test_rotary_with_the_kv_write_stores_what_rotary_then_reshape_and_cache_store(ops, dtype, cache_dtype, norm):
    """The Triton backend's fused launch (q/k norm, rotary, KV write) against the two launches it
    replaces: the same q and the same cache bytes, bit for bit (model-dtype and fp8 caches, a
    padding slot -1, k and v as views of one projection)."""
    from pagedllm.attention import triton_kernels

    num_tokens, hq, hk, hd = 7, 8, 2, 64
    qkv = _rand(num_tokens, (hq + 2 * hk) * hd, dtype=dtype, scale=3.0)
    q, k, v = (x.view(num_tokens, -1, hd) for x in qkv.split([hq * hd, hk * hd, hk * hd], dim=-1))
    rope = _rope(hd)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    slots = torch.tensor([5, 0, -1, 17, 31, 8, 9], device=DEVICE)
    kv_scale = torch.tensor([0.02, 0.05], device=DEVICE) if cache_dtype is not None else None
    norm_args = (_rand(hd, dtype=dtype) + 1, _rand(hd, dtype=dtype) + 1, 1e-6) if norm else ()
    results = []
    for fused in (False, True):
        cache = torch.zeros(2, 4, 8, hk, hd, dtype=cache_dtype or dtype, device=DEVICE)
        if fused:
            q_out, k_out = ops.rotary_embedding(positions, q, k, rope.cos_sin_cache, *norm_args,
                                                kv_write=ops.KVWrite(v, cache, slots, kv_scale))
            assert k_out is None
        else:
            q_out, k_out = ops.rotary_embedding(positions, q, k, rope.cos_sin_cache, *norm_args)
            triton_kernels.reshape_and_cache(k_out, v, cache, slots, kv_scale)
        results.append((q_out, cache.view(torch.uint8)))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert results[1][1].view(cache_dtype or dtype)[:, 0, 0].float().abs().sum() > 0  # slot 0 was written
    with pytest.raises(ValueError, match="kv_scale"):  # an fp8 cache without its scales
        ops.rotary_embedding(positions, q, k, rope.cos_sin_cache,
                             kv_write=ops.KVWrite(v, torch.zeros(2, 4, 8, hk, hd, dtype=torch.float8_e4m3fn,
                                                                 device=DEVICE), slots))
