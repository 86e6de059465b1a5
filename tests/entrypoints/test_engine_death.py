"""When the engine core dies, in-flight streams end with an error event and `pagedllm serve`
exits non-zero with the cause logged (vLLM's behaviour), unless --keep-serving-without-engine."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import TEST_KV_BYTES
from tests.entrypoints.test_openai_server import SRC_DIR, _children, _free_port


def _start(model: str, log_path, *flags: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--host", "127.0.0.1", "--port",
           str(port), "--kv-cache-memory-bytes", str(TEST_KV_BYTES), "--disable-log-stats", *flags]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC_DIR), "PAGEDLLM_API_KEY": ""}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.25)


def _engine_core_pid(proc: subprocess.Popen) -> int:
    def cmdline(pid: int) -> str:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")

    # The spawned engine core, not multiprocessing's resource tracker.
    (core_pid,) = [p for p in _children(proc.pid) if "spawn_main" in cmdline(p) and "resource_tracker" not in cmdline(p)]
    return core_pid


def _kill_engine_core(proc: subprocess.Popen) -> None:
    os.kill(_engine_core_pid(proc), signal.SIGKILL)


def test_a_dead_engine_errors_the_streams_then_the_server_exits_non_zero(tiny_models, tmp_path):
    log_path = tmp_path / "server.log"
    proc, url = _start(tiny_models["llama"], log_path)
    try:
        # The core's pid is found first and the request asks for as many tokens as the model's
        # 512 positions allow, so a loaded machine cannot finish the request before the kill.
        core_pid = _engine_core_pid(proc)
        body = {"prompt": "Once upon a time", "max_tokens": 480, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    os.kill(core_pid, signal.SIGKILL)
        assert events[-1] == "[DONE]", events[-3:]
        assert len(events) < 480, "the request finished before the core was killed"
        error = json.loads(events[-2]).get("error")
        assert error is not None and error["code"] == 503, events[-3:]
        rc = proc.wait(timeout=15)
        assert rc == 1
        log = log_path.read_text()
        assert "The engine core died" in log and "shutting the server down" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_keep_serving_without_engine_answers_503(tiny_models, tmp_path):
    log_path = tmp_path / "server.log"
    proc, url = _start(tiny_models["llama"], log_path, "--keep-serving-without-engine")
    try:
        _kill_engine_core(proc)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.5)  # past the watch's interval and grace: still up
        assert proc.poll() is None
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert "answering 503 from now on" in log_path.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def test_a_bad_server_flag_exits_with_its_message_while_the_core_builds(tiny_models):
    """The app is built while the core builds the model: a flag the app refuses exits 1 with the
    message, and the core started for it does not keep the command waiting (no hang)."""
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", tiny_models["llama"], "--port", str(_free_port()),
           "--kv-cache-memory-bytes", str(TEST_KV_BYTES), "--lora-modules", f"a={tiny_models['llama']}"]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC_DIR)}
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "--lora-modules needs --enable-lora" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - t0 < 30
