"""The text a GPU start-up's kept Triton jobs are filed under (pagedllm.ops.precompile.jobs_file,
built by the worker from ``config_text``): the same for the same engine in another process or
another model folder (a benchmark's temporary folder, a moved copy), different when a setting that
changes the kernels differs."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker.worker import config_text

_CHILD = ("import json, sys; from pagedllm.engine.arg_utils import EngineArgs; from pagedllm.worker.worker import config_text; "
          "print('TEXT ' + json.dumps(config_text(EngineArgs(model=sys.argv[1], max_num_seqs=8).create_engine_config())))")


def test_config_text_ignores_the_folder_and_the_process(tiny_models, tmp_path):
    model = tiny_models["qwen3"]
    copy = shutil.copytree(model, tmp_path / "moved")
    here = config_text(EngineArgs(model=model, max_num_seqs=8).create_engine_config())
    moved = config_text(EngineArgs(model=str(copy), max_num_seqs=8).create_engine_config())
    out = subprocess.run([sys.executable, "-c", _CHILD, model], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    other_process = json.loads([x for x in out.stdout.splitlines() if x.startswith("TEXT ")][-1][len("TEXT "):])
    assert here == moved == other_process
    assert model not in here and " at 0x" not in here
    assert config_text(EngineArgs(model=model, max_num_seqs=16).create_engine_config()) != here
    assert config_text(EngineArgs(model=tiny_models["llama"], max_num_seqs=8).create_engine_config()) != here
