"""The prefill kernel (attention/triton_prefill.py: long causal query runs, one head per program,
unmasked key tiles then the diagonal) against the float64 softmax, in batches that mix fresh
prompts, chunks after cached prefixes that end off a tile boundary, decodes and padding; over
key tiles smaller and larger than the cache's blocks, head groups that are not powers of two
and padded head dims. The cache is NaN outside the sequences' slots, so a key read past a run's
end shows. ``PAGEDLLM_PREFILL_KERNEL=0`` sends the same runs to the unified kernel."""
from __future__ import annotations

import random

import pytest
import torch

from tests.attention.test_triton_attention import TOL, check, make_batch, run_kernels
from tests.triton_env import ON_GPU

# (block_size, kv_heads, group, head_dim, dtype, runs as (cached context, query length), tiles or None)
CASES = [
    (16, 2, 2, 64, torch.float32, [(0, 70), (37, 45), (5, 1), (100, 33)], None),
    (8, 1, 3, 80, torch.float32, [(64, 40), (0, 17), (3, 1)], None),
    (64, 2, 1, 32, torch.float32, [(16, 48), (0, 96)], dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)),
    (16, 1, 2, 64, torch.float32, [(50, 90), (1, 2)], dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=2)),
    (16, 2, 4, 64, torch.bfloat16, [(20, 50), (0, 140), (9, 1)], None),
    (32, 1, 2, 256, torch.float16, [(40, 30), (0, 70)], None),
]
if ON_GPU:  # longer runs, where most key tiles are unmasked (on Hopper the Gluon kernel's too)
    CASES += [(16, 8, 4, 128, dt, [(0, 2048), (1000, 777), (3, 1), (4095, 300)], None)
              for dt in (torch.bfloat16, torch.float16)]
    CASES += [(32, 2, 3, 64, torch.float16, [(0, 700), (130, 257), (5, 1), (1500, 129)], None),
              (128, 1, 8, 128, torch.bfloat16, [(0, 129), (2047, 1025)], None),
              (8, 4, 1, 128, torch.bfloat16, [(333, 1000), (0, 300)], None)]


@pytest.fixture
def spy(kernels, monkeypatch):
    """Counts the prefill kernel's launches."""
    calls = []
    real = kernels.prefill_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "prefill_attention", counted)
    return calls


@pytest.mark.parametrize("case", range(len(CASES)))
def test_prefill_kernel_matches_float64_softmax(kernels, spy, monkeypatch, case):
    block_size, kvh, group, hd, dtype, runs, tiles = CASES[case]
    if tiles is not None:
        from pagedllm.attention import triton_prefill

        monkeypatch.setattr(triton_prefill, "prefill_tile_config", lambda head_dim, ieee: tiles)
    rng = random.Random(case)
    b = make_batch(rng, block_size=block_size, num_kv_heads=kvh, group=group, head_dim=hd, dtype=dtype, runs=runs,
                   num_pad_seqs=1, num_pad_rows=2)
    scale = hd ** -0.5
    gluon, gluon_module = _gluon_spy(monkeypatch)
    rels = {}
    # (PAGEDLLM_PREFILL_KERNEL, PAGEDLLM_GLUON_PREFILL): on a GPU both prefill kernels where Gluon applies
    for on, glu in (("1", "1"), ("0", "1")) + ((("1", "0"),) if gluon is not None else ()):
        monkeypatch.setenv("PAGEDLLM_PREFILL_KERNEL", on)
        monkeypatch.setenv("PAGEDLLM_GLUON_PREFILL", glu)
        spy.clear()
        launches = len(gluon) if gluon is not None else 0
        out = run_kernels(kernels, b, scale, None, max_query_len=max(q for _, q in runs))
        assert len(spy) == (on == "1"), f"prefill kernel launches with PAGEDLLM_PREFILL_KERNEL={on}: {spy}"
        if gluon is not None:  # Hopper: the Gluon kernel took the runs exactly where it applies
            hopper = torch.cuda.get_device_capability()[0] == 9
            fits = hd in (64, 128) and block_size <= gluon_module.CONFIG["BLOCK_N"]
            takes = hopper and on == glu == "1" and dtype != torch.float32 and fits
            assert len(gluon) - launches == takes, (CASES[case][:5], on, glu, gluon)
        rels[on + glu] = check(out, b, scale, None, dtype, (CASES[case][:5], runs, on, glu))
        assert out[b.qsl[-1].item():].isnan().all()  # rows past the last sequence: untouched
    assert rels["11"] < TOL[dtype] and rels.get("10", 0) < TOL[dtype]


def _gluon_spy(monkeypatch) -> tuple[list | None, object]:
    """On a GPU, a list the Gluon kernel's launches are appended to, and its module (None, None without a GPU or
    Gluon)."""
    if not ON_GPU:
        return None, None
    from pagedllm.attention import triton_prefill

    module = triton_prefill._gluon_prefill()
    if module is None:
        return None, None
    calls, real = [], module.prefill_attention_ws
    monkeypatch.setattr(module, "prefill_attention_ws", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    return calls, module


def test_windows_soft_caps_and_the_argument_keep_runs_on_the_unified_kernel(kernels, spy):
    """What the prefill kernel does not implement never reaches it (and stays exact), nor does
    anything when ``prefill_kernel=False`` (the benchmarks' A/B); by default it is taken."""
    rng = random.Random(7)
    runs = [(10, 40), (0, 33)]
    b = make_batch(rng, block_size=16, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32, runs=runs)
    for window, cap, kw in ((9, None, {}), (None, 4.0, {}), (None, None, {"prefill_kernel": False})):
        out = run_kernels(kernels, b, 0.125, window, max_query_len=40, logits_soft_cap=cap, **kw)
        check(out, b, 0.125, window, torch.float32, (window, cap, kw), soft_cap=cap)
    assert spy == []
    run_kernels(kernels, b, 0.125, None, max_query_len=40)
    assert len(spy) == 1


def test_prefill_kernel_compiles_for_sm90_with_wgmma_and_pipelined_loads(tmp_path):
    """The bf16 tiles compile for an H100 to ``wgmma`` dots fed by 16-byte ``cp.async`` K/V loads
    (what Triton's pipeliner emits when it keeps tiles in flight), fp8 caches too."""
    from tests.triton_env import HAS_TRITON, compile_for_sm90

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    body = r'''
from pagedllm.attention import triton_prefill as tp
sig = {"q_ptr": "*bf16", "out_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
       "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "kv_scale_ptr": "*fp32",
       "scale_log2": "fp32", "num_seqs": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32",
       "stride_oh": "i32", "stride_c_block": "i32", "stride_c_slot": "i32", "stride_c_head": "i32", "stride_bt": "i32"}
sig.update({k: c for k in ("NUM_HEADS", "GROUP", "BLOCK_M", "BLOCK_N", "BLOCK_SIZE", "HEAD_DIM", "DIM_PAD",
                           "Q_LEN_THRESHOLD", "IEEE", "KV_FP8")})
divisible = [a for a in sig if a.endswith("_ptr") or (a.startswith("stride") and a != "stride_bt")]
for hd in (128, 256):
    for fp8 in (False, True):
        cfg = tp.prefill_tile_config(hd, False)
        cons = dict(NUM_HEADS=32, GROUP=4, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_SIZE=16, HEAD_DIM=hd,
                    DIM_PAD=hd, Q_LEN_THRESHOLD=4, IEEE=False, KV_FP8=fp8)
        s = dict(sig, k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv") if fp8 else sig
        compile_(f"hd {hd} fp8 {fp8}", tp._prefill_kernel, s, cons, num_warps=cfg["num_warps"],
                 options={"num_stages": cfg["num_stages"]}, want_ptx=("wgmma.mma_async", "cp.async.cg.shared.global"),
                 divisible=divisible)
'''
    results = compile_for_sm90(body, tmp_path)
    assert results and all(v is True for v in results.values()), results


def test_gluon_prefill_kernel_compiles_for_sm90_warp_specialized_with_tma(tmp_path):
    """The Gluon kernel (Hopper's prefill; experimental, renamed between Triton releases) compiles for an H100 with
    this Triton: wgmma dots, partitions with their own register budgets, TMA bulk copies and cp.async."""
    from tests.triton_env import GLUON_PREFILL_SIGNATURE, HAS_TRITON, compile_for_sm90

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    body = GLUON_PREFILL_SIGNATURE + r'''
from pagedllm.attention import gluon_prefill as gp
want = ("wgmma.mma_async", "setmaxnreg", "cp.async.bulk.tensor", "cp.async.mbarrier.arrive.noinc")
for dt in ("bf16", "fp16"):
    for hd in (64, 128):
        sig, cons, divisible = gluon_prefill_signature(gp, dt, hd)
        compile_(f"{dt} hd {hd}", gp.prefill_ws_kernel, sig, cons, num_warps=gp.CONFIG["num_warps"], want_ptx=want,
                 divisible=divisible, gluon=True)
'''
    results = compile_for_sm90(body, tmp_path)
    assert len(results) == 4 and all(v is True for v in results.values()), results


@pytest.mark.skipif(not ON_GPU, reason="CUDA streams: the interpreter has one")
@pytest.mark.parametrize("unified", [False, True], ids=["prefill_kernel", "unified_long_tiles"])
def test_mixed_step_decodes_beside_the_chunks_equal_one_stream(kernels, monkeypatch, unified):
    """A mixed step's decodes run on a second stream beside the chunks (``_fork``): the output is
    the one stream's bit for bit, the side stream is used, and a read of ``out`` right after the
    call (on the current stream, no synchronize) already sees the decodes' rows."""
    rng = random.Random(11)
    runs = [(rng.randint(1000, 4000), 1) for _ in range(12)] + [(0, 3000), (2000, 900), (7, 1)]
    b = make_batch(rng, block_size=16, num_kv_heads=8, group=2, head_dim=128, dtype=torch.bfloat16, runs=runs,
                   num_pad_seqs=1, num_pad_rows=1)
    forks = []
    real = kernels._fork

    def fork(device):
        forks.append(real(device))
        return forks[-1]

    monkeypatch.setattr(kernels, "_fork", fork)
    outs = []
    for on in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_ATTENTION_SIDE_STREAM", on)
        out = run_kernels(kernels, b, 128 ** -0.5, None, max_query_len=3000, prefill_kernel=not unified)
        outs.append(out.clone())  # cloned on the current stream: must follow the side stream's writes
    assert isinstance(forks[0], torch.cuda.Stream) and forks[1] is None
    assert torch.equal(outs[0][:b.num_real_tokens], outs[1][:b.num_real_tokens])
    check(outs[0], b, 128 ** -0.5, None, torch.bfloat16, runs)


def test_the_gluon_kernel_sets_tritons_scratch_allocator_only_where_none_is_set():
    """Its programs build TMA descriptors in global scratch memory, which Triton asks an allocator for: a thread
    without one gets the kernel's (torch memory), one the user set stays; on a CPU it takes no run. In a fresh
    process: Gluon does not import under the interpreter this test session may run."""
    import os
    import subprocess
    import sys

    from tests.triton_env import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    script = r'''
import contextvars, torch, triton
from triton.runtime import _allocation
from pagedllm.attention import gluon_prefill as gp, triton_prefill as tp

def fresh_thread_context():
    gp._ensure_allocator()
    assert _allocation._allocator.get() is gp._scratch
    mine = lambda size, alignment, stream: torch.empty(size, dtype=torch.int8)
    triton.set_allocator(mine)
    gp._ensure_allocator()
    assert _allocation._allocator.get() is mine

contextvars.Context().run(fresh_thread_context)
assert tp._gluon_prefill() is gp
q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
assert not gp.supports(q, torch.zeros(2, 3, 16, 1, 128, dtype=torch.bfloat16), q)
print("ok")
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]
