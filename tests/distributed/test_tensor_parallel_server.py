"""`pagedllm serve --tensor-parallel-size 2` (gloo on CPU): it serves, and a worker that dies
makes /health unhealthy (503) and requests fail with an error instead of hanging."""
from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import psutil

from tests.entrypoints.test_openai_server import _serve


def test_tp2_server_serves_then_reports_a_dead_worker(tiny_models, tmp_path):
    log_path = tmp_path / "server.log"
    for base_url in _serve(tiny_models["llama"], log_path, ["--tensor-parallel-size", "2", "--served-model-name", "m",
                                                            "--disable-log-stats",
                                                            # answer 503 rather than exit (the default
                                                            # since issue 14), so /health can be read
                                                            "--keep-serving-without-engine"], {"PAGEDLLM_API_KEY": ""}):
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=30)
        out = client.completions.create(model="m", prompt="Hello", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4

        # server -> engine core process -> one worker process per rank
        server = next(p for p in psutil.Process(os.getpid()).children()
                      if "pagedllm.entrypoints.cli" in " ".join(p.cmdline()))
        workers = [w for core in server.children() for w in core.children()]
        assert len(workers) == 2, [w.cmdline() for w in workers]
        os.kill(workers[1].pid, signal.SIGKILL)

        start = time.monotonic()
        try:
            client.completions.create(model="m", prompt="Hello again", max_tokens=4, temperature=0)
            raise AssertionError("a request succeeded after a worker died")
        except openai.APIStatusError as e:
            assert e.status_code in (500, 503), e
        assert time.monotonic() - start < 20, "the failure took too long to surface"
        deadline = time.monotonic() + 10
        while httpx.get(f"{base_url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health still reports healthy after a worker died"
            time.sleep(0.2)
        body = httpx.get(f"{base_url}/health", timeout=5).json()
        assert "rank 1" in body["error"]["message"], body
