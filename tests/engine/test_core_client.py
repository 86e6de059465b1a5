"""EngineCore in its own process: request errors come back as messages, start-up errors
are raised with the child's text, and the child never outlives its parent."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.core.messages import EngineCoreOutputs, EngineCoreRequest, RequestError
from pagedllm.engine.core_client import EngineCoreClient, EngineDeadError
from tests.conftest import TEST_KV_BYTES

SRC_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))


def _request(request_id: str, prompt_token_ids: list[int], max_tokens: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt_token_ids, SamplingParams(temperature=0, max_tokens=max_tokens),
                             eos_token_id=None, arrival_time=time.time())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_bad_request_comes_back_as_an_error_and_the_loop_keeps_serving(tiny_models):
    config = EngineArgs(model=tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES,
                        disable_log_stats=True).create_engine_config()
    client = EngineCoreClient(config)
    try:
        client.add_request(_request("too-long", [5] * 600))
        error = client.get_output(timeout_s=30)
        assert isinstance(error, RequestError) and error.request_id == "too-long" and "max_model_len" in error.message
        client.add_request(_request("ok", [5, 6, 7], max_tokens=3))
        client.add_request(_request("aborted", [8, 9], max_tokens=400))
        client.abort_requests(["aborted"])
        tokens, finish = {"ok": [], "aborted": []}, {}
        while len(finish) < 2:
            core_outputs = client.get_output(timeout_s=30)
            assert isinstance(core_outputs, EngineCoreOutputs)
            for out in core_outputs.outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    finish[out.request_id] = out.finish_reason
        assert finish == {"ok": "length", "aborted": "abort"} and len(tokens["ok"]) == 3
        stats = client.call_utility("get_stats").result(timeout=30)
        assert stats["num_free_blocks"] == stats["num_blocks"] == client.num_blocks
        assert stats["num_running"] == stats["num_waiting"] == 0
        with pytest.raises(RuntimeError, match="unknown utility"):
            client.call_utility("rm_rf").result(timeout=30)
    finally:
        client.shutdown()
    assert client.process.exitcode == 0
    with pytest.raises(EngineDeadError):
        client.add_request(_request("late", [1]))


def test_start_up_failure_raises_with_the_child_s_message(tiny_models):
    config = EngineArgs(model=tiny_models["llama"], num_gpu_blocks_override=2,
                        disable_log_stats=True).create_engine_config()
    with pytest.raises(RuntimeError, match="fewer than max_model_len"):
        EngineCoreClient(config)


def test_core_process_exits_when_its_parent_is_killed(tiny_models, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from pagedllm import EngineArgs
        from pagedllm.engine.core_client import EngineCoreClient

        if __name__ == "__main__":
            config = EngineArgs(model={tiny_models["llama"]!r}, kv_cache_memory_bytes={TEST_KV_BYTES},
                                disable_log_stats=True).create_engine_config()
            client = EngineCoreClient(config)
            print(client.process.pid, flush=True)
            time.sleep(600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": SRC_DIR})
    try:
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child_pid), "the engine core process outlived its parent"
    finally:
        parent.kill()
        parent.wait()


def test_offline_and_engine_modules_do_not_import_server_dependencies():
    code = ("import sys, pagedllm.entrypoints.llm, pagedllm.entrypoints.cli, pagedllm.engine.async_llm; "
            "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'openai', 'httpx', 'prometheus_client') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": SRC_DIR})


def test_serve_spawns_its_core_before_importing_torch():
    """`pagedllm serve` starts the core process first, so the core's imports (torch, transformers,
    the engine) overlap this process's own instead of following them."""
    code = ("import sys\n"
            "from pagedllm.engine import core_client\n"
            "from pagedllm.entrypoints import cli\n"
            "class Probe:\n"
            "    def __init__(self, config):\n"
            "        print('TORCH_LOADED', 'torch' in sys.modules, config); sys.exit(0)\n"
            "core_client.EngineCoreClient = Probe\n"
            "sys.argv = ['pagedllm', 'serve', '--port', '8999']\n"
            "cli.main()\n")  # as the console script calls it (a process of its own)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": SRC_DIR})
    assert "TORCH_LOADED False None" in out.stdout, out.stdout + out.stderr[-2000:]


def test_async_llm_fails_pending_requests_when_the_core_dies(tiny_models):
    import asyncio

    from pagedllm import RequestOutputKind
    from pagedllm.engine.async_llm import AsyncLLM

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES,
                                                      disable_log_stats=True))
        try:
            params = SamplingParams(temperature=0, max_tokens=5, output_kind=RequestOutputKind.DELTA)
            outs = [o async for o in engine.generate("Hello", params, "first")]
            assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 5
            await engine.check_health()
            long = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            stream = engine.generate("Hello", long, "doomed")
            await stream.__anext__()
            os.kill(engine.engine_core.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="died"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError):
                engine.add_request("after", "Hello", params)
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_a_core_started_before_its_config_serves_and_one_never_configured_exits(tiny_models):
    """``EngineCoreClient(None)`` spawns the process first (its imports overlap the caller's config
    work); ``configure`` + ``wait_ready`` then start the core. One shut down before it had a
    config ends at once, and a bad argument to AsyncLLM.from_engine_args leaves no process."""
    import multiprocessing

    from pagedllm.engine.async_llm import AsyncLLM

    client = EngineCoreClient(None)
    assert client.num_blocks is None
    config = EngineArgs(model=tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES,
                        disable_log_stats=True).create_engine_config()
    client.configure(config)
    client.wait_ready()
    try:
        with pytest.raises(RuntimeError, match="already has its config"):  # a second config is refused here
            client.configure(config)
        client.add_request(_request("ok", [5, 6, 7], max_tokens=2))
        out = client.get_output(timeout_s=30)
        assert isinstance(out, EngineCoreOutputs) and out.outputs[0].request_id == "ok" and client.num_blocks > 0
    finally:
        client.shutdown()
    assert client.process.exitcode == 0

    unused = EngineCoreClient(None)
    unused.shutdown()
    assert not unused.process.is_alive()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="max_num_seqs"):
        AsyncLLM.from_engine_args(EngineArgs(model=tiny_models["llama"], max_num_seqs=0))
    assert time.monotonic() - t0 < 5 and multiprocessing.active_children() == []


def test_async_llm_can_return_before_its_core_is_ready(tiny_models):
    """``wait_ready=False`` (the server builds its app meanwhile): ``wait_ready()`` then waits, and
    raises the core's start-up error with the engine shut down."""
    from pagedllm.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES,
                                                  disable_log_stats=True), wait_ready=False)
    try:
        assert engine.engine_core.num_blocks is None
        engine.wait_ready()
        engine.wait_ready()  # a second call returns at once
        assert engine.engine_core.num_blocks > 0 and engine.engine_core.is_alive()
    finally:
        engine.shutdown()
    bad = AsyncLLM.from_engine_args(EngineArgs(model=tiny_models["llama"], num_gpu_blocks_override=2,
                                               disable_log_stats=True), wait_ready=False)
    with pytest.raises(RuntimeError, match="fewer than max_model_len"):
        bad.wait_ready()
    assert not bad.engine_core.process.is_alive()
