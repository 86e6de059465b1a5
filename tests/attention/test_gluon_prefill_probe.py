"""scripts/gluon_prefill_probe.py (issue 19's warp-specialized prefill attention in Gluon, a probe run on the GPU
pass) still compiles for sm_90 with this Triton: Gluon is experimental and renames things between releases."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_gluon_prefill_probe_compiles_for_sm90_with_and_without_ping_pong(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gluon_prefill_probe.py"), "--compile"],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and [ptx["pingpong"] for ptx in lines] == [False, True], proc.stderr[-3000:]
    for ptx in lines:  # two consumer warpgroups' dots, partitions with their own register counts, the copies
        assert ptx["wgmma.mma_async"] > 0 and ptx["setmaxnreg"] > 0 and ptx["cp.async.mbarrier.arrive.noinc"] > 0, ptx
    assert any(line.startswith("loop of") for line in proc.stdout.splitlines()), proc.stdout[-2000:]
