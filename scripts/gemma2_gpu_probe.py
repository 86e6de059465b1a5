"""Where does tiny Gemma 2 leave transformers on CUDA? Greedy tokens against transformers (fp32)
with each GPU piece swapped for its torch reference in turn: the attention backend, the fused
ops, CUDA graphs. Usage (GPU machine, repo root): python scripts/gemma2_gpu_probe.py TOKENIZER_DIR"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.getcwd())

CASES = {
    "default": {},
    "eager": {"PROBE_EAGER": "1"},
    "torch-attention": {"PAGEDLLM_ATTENTION_BACKEND": "torch"},
    "torch-ops": {"PAGEDLLM_DISABLE_TRITON_OPS": "1"},
    "torch-attention+ops": {"PAGEDLLM_ATTENTION_BACKEND": "torch", "PAGEDLLM_DISABLE_TRITON_OPS": "1"},
}


def child(model_dir: str) -> None:
    from tests.engine.test_correctness import generate_ids, hf_greedy, make_llm, mixed_prompts

    prompts = mixed_prompts()
    expected = hf_greedy(model_dir, prompts)
    got = generate_ids(make_llm(model_dir, enforce_eager=os.environ.get("PROBE_EAGER") == "1"), prompts)
    bad = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
    print(f"RESULT mismatching prompts {bad} of {len(prompts)}", flush=True)


def main() -> None:
    if sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    from tests.conftest import build_tiny_model

    for arch in ("gemma2", "gemma3"):
        model_dir = build_tiny_model(arch, tempfile.mkdtemp(), sys.argv[1])
        for name, env in CASES.items():
            out = subprocess.run([sys.executable, __file__, "--child", model_dir], env={**os.environ, **env},
                                 capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), out.stderr[-300:])
            print(f"{arch:7s} {name:20s} {line}", flush=True)


if __name__ == "__main__":
    main()
