"""LLM.start_profile() / stop_profile() (vLLM's calls): each worker writes a torch.profiler trace
and a summary of where its time went under PAGEDLLM_TORCH_PROFILER_DIR; off without it."""
from __future__ import annotations

import json

import pytest

from pagedllm import SamplingParams, TokensPrompt
from tests.engine.test_correctness import make_llm


def test_profile_writes_trace_and_summary(tiny_models, tmp_path, monkeypatch):
    llm = make_llm(tiny_models["llama"])
    with pytest.raises(RuntimeError, match="PAGEDLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("PAGEDLLM_TORCH_PROFILER_DIR", str(tmp_path))
    assert llm.stop_profile() == [None]  # nothing ran: nothing written, the engine keeps serving
    llm.start_profile()
    llm.start_profile()  # a second start keeps the running session
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4), use_tqdm=False)
    paths = llm.stop_profile()
    assert paths == [str(tmp_path / "rank0.txt")]
    summary = (tmp_path / "rank0.txt").read_text()
    assert summary.startswith("rank 0: ") and "aten::" in summary  # the model's ops, by their own time
    trace = json.loads((tmp_path / "rank0.trace.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert llm.stop_profile() == [None]
