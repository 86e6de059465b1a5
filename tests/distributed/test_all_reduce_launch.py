"""The Triton one-shot all-reduce's launch shape (distributed/triton_all_reduce.launch_shape): every
element of a message in exactly one program's chunk, chunks of whole blocks, no program without
elements (it would still meet its peers), at most the cap, and the barrier flags of the widest
launch within the flag area after the data (custom_all_reduce). The kernel itself needs two GPUs:
tests/gpu/test_custom_all_reduce.py."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from pagedllm.distributed import custom_all_reduce as car  # noqa: E402
from pagedllm.distributed.triton_all_reduce import launch_shape  # noqa: E402


@pytest.mark.parametrize("max_programs", [264, 296, 1])
def test_launch_shape_covers_every_element_once(max_programs):
    block = car._TRITON_BLOCK
    for n in (8, block - 8, block, block + 8, 32 * 4096, 37 * 4096, 256 * 4096, 1024 * 4096, 2048 * 4096 // 2 + 8):
        programs, chunk = launch_shape(n, max_programs, block)
        assert 1 <= programs <= max_programs and chunk % block == 0, (n, programs, chunk)
        assert (programs - 1) * chunk < n <= programs * chunk, (n, programs, chunk)  # none empty, all covered
    # the widest launch's flags (programs x up to 8 ranks, int32) fit the area after the data
    assert max(max_programs, 2 * 148) * 8 * 4 <= car._FLAG_BYTES


_AR_BODY = r"""
from pagedllm.distributed.triton_all_reduce import one_shot_all_reduce_kernel as k
sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "bufs": "*i64", "flags": "*i64", "state": "*i32", "n": "i32",
       "chunk": "i32", "half": "i32", "RANK": c, "WORLD": c, "BLOCK": c, "ENTER": c}
for enter in (False, True):
    compile_(f"enter={enter}", k, sig, {"RANK": 1, "WORLD": 2, "BLOCK": 4096, "ENTER": enter}, num_warps=8,
             want_ptx=["griddepcontrol.wait", "griddepcontrol.launch_dependents"] if enter else None,
             divisible=("x_ptr", "out_ptr"))
from pagedllm.distributed.triton_all_reduce import lamport_all_reduce_kernel as lk
sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "bufs": "*i64", "state": "*i32", "n": "i32", "chunk": "i32",
       "slot": "i32", "RANK": c, "WORLD": c, "BLOCK": c, "ENTER": c}
for enter in (False, True):
    compile_(f"lamport enter={enter}", lk, sig, {"RANK": 0, "WORLD": 2, "BLOCK": 1024, "ENTER": enter}, num_warps=4,
             want_ptx=["ld.volatile.global", "griddepcontrol.wait"] if enter else ["ld.volatile.global"],
             divisible=("x_ptr", "out_ptr"))
"""


def test_kernel_compiles_for_sm90_and_waits_in_kernel_when_launched_early(tmp_path):
    """The kernel as a decode graph launches it (ENTER: early, in a layer's chain) waits for the
    projection before it and lets the next kernel launch; both variants compile for sm_90."""
    from tests.triton_env import compile_for_sm90

    results = compile_for_sm90(_AR_BODY, tmp_path)
    assert results == {"enter=False": True, "enter=True": True, "lamport enter=False": True,
                       "lamport enter=True": True}, results
