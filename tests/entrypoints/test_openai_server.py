"""The OpenAI-compatible server end to end: a real `pagedllm serve` process, the official
`openai` client, outputs checked against the offline `LLM` on the same tiny model."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from pagedllm import LLM, SamplingParams  # noqa: E402
from tests.conftest import TEST_KV_BYTES  # noqa: E402

API_KEY = "test-key"
MODEL_NAME = "tiny"
SRC_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "src")
STARTUP_TIMEOUT_S = 90
ROOT_PATH = "/proxy"
MAX_LOG_LEN = 12
ALLOWED_ORIGIN = "https://app.example"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _serve(model: str, log_path, extra_args: list[str], env: dict[str, str]):
    """Run `pagedllm serve` until the generator is closed; yields its base URL. On exit: SIGTERM,
    a clean shutdown, and no engine core process left behind."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--kv-cache-memory-bytes", str(TEST_KV_BYTES), "--uvicorn-log-level", "warning",
           *extra_args]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC_DIR), **env}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.25)
    engine_pids = _children(proc.pid)
    yield base_url
    # SIGTERM: uvicorn shuts down gracefully and the engine core process goes with it.
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the server ignored SIGTERM:\n{log_path.read_text()[-3000:]}")
    # uvicorn re-raises the signal once it has shut down gracefully, so -SIGTERM is a clean exit.
    log = log_path.read_text()
    assert rc in (0, -signal.SIGTERM), log[-3000:]
    assert "Engine shut down" in log, log[-3000:]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in engine_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in engine_pids), "the engine core process outlived the server"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    """The main server: API key from the environment, two served names, default server flags but
    a --root-path, and no request log lines."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    yield from _serve(tiny_models["llama"], log_path,
                      ["--served-model-name", MODEL_NAME, "other-name", "--disable-log-stats", "--disable-log-requests",
                       "--root-path", ROOT_PATH], {"PAGEDLLM_API_KEY": API_KEY})
    assert "Received request" not in log_path.read_text()


@pytest.fixture(scope="module")
def flags_server(tiny_models, tmp_path_factory):
    """A second server with the optional server flags on (and no API key); yields (URL, log path)."""
    log_path = tmp_path_factory.mktemp("flags-server") / "server.log"
    args = ["--served-model-name", MODEL_NAME, "--enable-request-id-headers", "--disable-fastapi-docs",
            "--enable-prompt-tokens-details", "--max-log-len", str(MAX_LOG_LEN), "--chat-template-content-format",
            "string", "--response-role", "bot", "--allowed-origins", json.dumps([ALLOWED_ORIGIN]),
            "--allowed-methods", '["GET", "POST"]', "--allow-credentials"]
    env = {"PAGEDLLM_LOG_STATS_INTERVAL": "0.5", "PAGEDLLM_API_KEY": ""}
    for url in _serve(tiny_models["llama"], log_path, args, env):
        yield url, log_path


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        yield c


def _wait_all_blocks_free(http, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = http.get("/internal/stats").json()
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and stats["num_free_blocks"] == stats["num_blocks"]:
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"blocks still held after {timeout_s} s: {stats}")
        time.sleep(0.05)


def test_models_health_and_version(http, client):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    assert http.post("/start_profile").status_code == 404  # profiling routes only with PAGEDLLM_TORCH_PROFILER_DIR
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "other-name"]


def test_greedy_completion_equals_llm_generate_with_usage(client, llm):
    prompt = "The capital of France is"
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected.outputs[0].text
    assert resp.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    # Streamed, the deltas add up to the same text, and the usage chunk comes last.
    chunks = list(client.completions.create(model="other-name", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.outputs[0].finish_reason


def test_completion_prompt_forms_n_echo_and_logprobs(client, llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Once upon a time")
    sp = SamplingParams(temperature=0, max_tokens=5)
    expected = llm.generate([{"prompt_token_ids": ids}, "hello there"], sp, use_tqdm=False)
    resp = client.completions.create(model=MODEL_NAME, prompt=[ids, tok.encode("hello there")], max_tokens=5,
                                     temperature=0)
    assert [c.text for c in resp.choices] == [e.outputs[0].text for e in expected]
    assert resp.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    resp = client.completions.create(model=MODEL_NAME, prompt=["Once upon a time", "hello there"], max_tokens=5,
                                     temperature=0, n=2, echo=True, logprobs=2)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    by_index = {c.index: c for c in resp.choices}
    assert by_index[1].text == "Once upon a time" + expected[0].outputs[0].text  # greedy: both samples agree
    assert by_index[3].text == "hello there" + expected[1].outputs[0].text
    lp = by_index[0].logprobs  # echo: the prompt's tokens first
    n_prompt = len(expected[0].prompt_token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 5
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
    assert resp.usage.completion_tokens == 4 * 5


def test_echo_with_logprobs_reports_the_prompt_tokens_first(client, llm):
    prompt = "Once upon a time there was"
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2),
                            use_tqdm=False)[0]
    prompt_ids, out = expected.prompt_token_ids, expected.outputs[0]
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                     logprobs=2)
    choice = resp.choices[0]
    choice_lp = choice.logprobs
    assert choice.text == prompt + out.text
    n = len(prompt_ids) + 4
    assert len(choice_lp.tokens) == len(choice_lp.token_logprobs) == len(choice_lp.top_logprobs) == \
        len(choice_lp.text_offset) == n
    # The first prompt token has nothing before it to score it.
    assert choice_lp.token_logprobs[0] is None and choice_lp.top_logprobs[0] is None
    reference = [expected.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt_ids) if i > 0] + \
        [out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)]
    assert choice_lp.token_logprobs[1:] == pytest.approx(reference, abs=1e-4)
    assert all(2 <= len(top) <= 3 for top in choice_lp.top_logprobs[1:])
    assert "".join(choice_lp.tokens) == choice.text
    assert choice_lp.text_offset == [sum(len(t) for t in choice_lp.tokens[:i]) for i in range(n)]
    # Streamed, the chunks add up to the same block.
    chunks = [c.choices[0] for c in client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2, stream=True)]
    assert "".join(c.text for c in chunks) == choice.text
    assert sum((c.logprobs.tokens for c in chunks), []) == choice_lp.tokens
    assert sum((c.logprobs.text_offset for c in chunks), []) == choice_lp.text_offset
    streamed = sum((c.logprobs.token_logprobs for c in chunks), [])
    assert streamed[0] is None and streamed[1:] == pytest.approx(choice_lp.token_logprobs[1:], abs=1e-5)


def test_chat_greedy_equals_llm_chat_stream_and_not(client, llm):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=10,
                                          temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.outputs[0].text
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-2].choices[0].finish_reason == expected.outputs[0].finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.total_tokens == len(expected.prompt_token_ids) + len(expected.outputs[0].token_ids)


def test_chat_continue_final_message_and_logprobs(client, llm):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, my"}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                        add_generation_prompt=False, continue_final_message=True)[0]
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert resp.choices[0].message.content == expected.outputs[0].text
    content = resp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)


def test_64_concurrent_streams_complete_unmixed(server, llm):
    prompts = [f"Request number {i} says" for i in range(64)]
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)

    async def run() -> list[tuple[set[str], str]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)

        async def one(prompt: str) -> tuple[set[str], str]:
            stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                                      temperature=0, stream=True)
            ids, text = set(), ""
            async for chunk in stream:
                ids.add(chunk.id)
                text += chunk.choices[0].text
            return ids, text

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert all(len(ids) == 1 for ids, _ in results)
    assert len({next(iter(ids)) for ids, _ in results}) == len(prompts)
    assert [text for _, text in results] == [e.outputs[0].text for e in expected]


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(http):
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: closing it would close the connection early
        data = [line for line in (next(lines) for _ in range(5)) if line.startswith("data: ")]
        assert data and "[DONE]" not in data[-1]
        stats = http.get("/internal/stats").json()
        assert stats["num_running"] == 1 and stats["num_free_blocks"] < stats["num_blocks"]
    _wait_all_blocks_free(http, timeout_s=2)


def test_client_timeout_on_non_streaming_request_aborts_it(http):
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story", "max_tokens": 450, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.TimeoutException):
        http.post("/v1/completions", json=body, timeout=0.5)
    _wait_all_blocks_free(http, timeout_s=2)  # generating it all would take several seconds


def test_api_key_is_required_on_v1_only(server):
    assert httpx.get(f"{server}/health").status_code == 200
    r = httpx.get(f"{server}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()


LONG_PROMPT = " ".join(["word"] * 600)
BAD_REQUESTS = [
    # (path, body, status, a word the message must contain)
    ("/v1/completions", "{not json", 400, "JSON"),
    ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 100}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1e9}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "seed": 2 ** 70}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "top_k": 10 ** 20}, 400, "top_k"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "empty"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "max_model_len"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "token ids"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": True, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/completions", {"prompt": "x", "suffix": "and so on"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "priority": "high"}, 400, "priority"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     400, "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "max_model_len"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(http):
    for path, body, status, word in BAD_REQUESTS:
        if isinstance(body, str):
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        assert word.lower() in error["message"].lower(), (body, error)
    r = http.get("/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    ok = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "still alive", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    _wait_all_blocks_free(http)
    assert http.get("/health").status_code == 200


def test_engine_args_flags_are_generated_from_the_dataclass():
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.cli import engine_args_from, make_parser

    ns = make_parser().parse_args(["serve", "m", "--max-model-len", "128", "--no-enable-prefix-caching",
                                   "--gpu-memory-utilization", "0.5", "--override-generation-config",
                                   json.dumps({"temperature": 0.1}), "--served-model-name", "a", "b"])
    args = engine_args_from(ns)
    assert isinstance(args, EngineArgs)
    assert (args.model, args.max_model_len, args.enable_prefix_caching, args.gpu_memory_utilization) == \
        ("m", 128, False, 0.5)
    assert args.override_generation_config == {"temperature": 0.1} and ns.served_model_name == ["a", "b"]
    help_text = make_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for name in EngineArgs.field_names():
        assert "--" + name.replace("_", "-") in help_text
    assert "(default: 0.9)" in help_text


def test_tokenize_and_detokenize_round_trip(http, llm):
    tok = llm.get_tokenizer()
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "Hello, paged world!"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Hello, paged world!") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == llm.llm_engine.model_config.max_model_len
    r = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode(body["tokens"])
    # Chat messages go through the chat template, exactly as /v1/chat/completions renders them.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = http.post("/tokenize", json={"messages": messages})
    expected = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    assert r.json()["tokens"] == expected
    for path, payload in (("/tokenize", {}), ("/tokenize", {"prompt": "x", "messages": messages}),
                          ("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": "abc"}),
                          ("/tokenize", {"prompt": "x", "model": "no-such-model"})):
        r = http.post(path, json=payload)
        assert r.status_code in (400, 404) and "message" in r.json()["error"], (path, payload, r.text)


def _scrape(server) -> dict[str, float]:
    """`/metrics` parsed by prometheus_client's own parser: sample name + labels -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{server}/metrics", timeout=10)  # open without the API key
    assert r.status_code == 200
    values = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            values[sample.name + (f"[{reason}]" if reason else "")] = sample.value
    return values


def test_metrics_parse_and_counters_move(server, client, llm):
    before = _scrape(server)
    prompt = "Counting tokens for the metrics test"
    n_prompt = len(llm.get_tokenizer().encode(prompt))
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = _scrape(server)
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert moved["pagedllm:generation_tokens_total"] == 5
    assert moved["pagedllm:prompt_tokens_total"] == n_prompt
    assert moved["pagedllm:request_success_total[length]"] == 1
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert moved[f"pagedllm:{hist}_count"] == 1, hist
    assert moved["pagedllm:prefix_cache_queries_total"] >= n_prompt
    assert after["pagedllm:num_requests_running"] == 0 and "pagedllm:kv_cache_usage_perc" in after
    assert "pagedllm:num_preemptions_total" in after and "pagedllm:num_requests_waiting" in after


def test_vllm_extra_parameters_reach_the_engine(http, llm):
    token_id = llm.get_tokenizer().encode(" Paris")[-1]
    r = http.post("/v1/completions", json={"prompt": "The capital is", "max_tokens": 3, "ignore_eos": True,
                                           "allowed_token_ids": [token_id], "request_id": "from-the-body",
                                           "priority": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "cmpl-from-the-body"
    assert body["choices"][0]["text"] == llm.get_tokenizer().decode([token_id] * 3)


# ---- server flags (the flags_server fixture turns them on) ------------------------------------------
def test_x_request_id_is_echoed_or_generated_and_names_the_request(flags_server, server):
    url, _ = flags_server
    body = {"prompt": "Hello", "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "client-chosen-7"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-chosen-7"
    assert r.json()["id"] == "cmpl-client-chosen-7"
    r = httpx.post(f"{url}/v1/completions", json=body)
    generated = r.headers["x-request-id"]
    assert len(generated) == 32 and r.json()["id"] == f"cmpl-{generated}"
    assert httpx.get(f"{url}/health").headers["x-request-id"]  # on every response
    # Without the flag: no header, but a client's X-Request-Id still names the request (vLLM's rule).
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 2},
                   headers={"X-Request-Id": "abc", "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and "x-request-id" not in r.headers and r.json()["id"] == "chatcmpl-abc"


def test_cors_preflight_returns_the_allow_headers(flags_server, server):
    url, _ = flags_server
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(f"{url}/v1/completions", headers=preflight)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(f"{url}/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Origin": ALLOWED_ORIGIN})
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    # The main server: the defaults allow any origin, and a preflight needs no API key.
    r = httpx.options(f"{server}/v1/chat/completions", headers={**preflight, "Origin": "https://any.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "https://any.example")


def test_fastapi_docs_are_off_with_the_flag_and_root_path_is_honoured(flags_server, server):
    url, _ = flags_server
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{path}").status_code == 404, path
    assert httpx.get(f"{server}/docs").status_code == 200
    assert httpx.get(f"{server}/openapi.json").json()["servers"] == [{"url": ROOT_PATH}]
    # Behind a proxy that keeps the prefix, the routes (and the API key check) still apply.
    assert httpx.get(f"{server}{ROOT_PATH}/v1/models").status_code == 401
    r = httpx.get(f"{server}{ROOT_PATH}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL_NAME


def test_prompt_tokens_details_count_prefix_cache_hits(flags_server, client):
    url, _ = flags_server
    flags_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    prompt = "The same long preamble, repeated so that it fills several KV blocks. " * 6
    first = flags_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    second = flags_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    chunks = list(flags_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}] * 2, max_tokens=2, stream=True,
        stream_options={"include_usage": True}))
    chunks += list(flags_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}] * 2, max_tokens=2, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    # Without --enable-prompt-tokens-details the field is absent.
    assert client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1).usage.prompt_tokens_details \
        is None


# Renders string content as "[S]text" and a list of parts as "[L]part;part;" — and, looping over
# message['content'], auto-detects as an "openai"-format template.
PROBE_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}[S]{{ m['content'] }}"
                  "{% else %}[L]{% for p in m['content'] %}{{ p['text'] }};{% endfor %}{% endif %}{% endfor %}")


def _rendered(url: str, llm, headers: dict) -> str:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    r = httpx.post(f"{url}/tokenize", json={"messages": messages, "chat_template": PROBE_TEMPLATE,
                                            "add_generation_prompt": False}, headers=headers)
    assert r.status_code == 200, r.text
    return llm.get_tokenizer().decode(r.json()["tokens"])


def test_chat_template_content_format_string_vs_openai(flags_server, server, llm):
    from pagedllm.entrypoints.chat_utils import detect_content_format

    assert _rendered(server, llm, {}) == "[L]a;b;"  # auto: the template loops over content parts
    assert _rendered(flags_server[0], llm, {}) == "[S]a\nb"  # --chat-template-content-format string
    assert detect_content_format(PROBE_TEMPLATE) == "openai"
    # The offline LLM.chat takes the same choice (vLLM's chat_template_content_format).
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    for content_format, rendered in (("string", "[S]a\nb"), ("openai", "[L]a;b;"), ("auto", "[L]a;b;")):
        out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=PROBE_TEMPLATE,
                       add_generation_prompt=False, chat_template_content_format=content_format)[0]
        assert llm.get_tokenizer().decode(out.prompt_token_ids) == rendered
    assert detect_content_format(llm.get_tokenizer().chat_template) == "string"  # SmolLM2's
    assert detect_content_format("{% for m in messages %}{% set c = m.content %}{% for p in c | list %}"
                                 "{{ p.text }}{% endfor %}{% endfor %}") == "openai"


def test_response_role_names_the_reply_unless_continuing_a_message(flags_server):
    url, _ = flags_server
    flags_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    assert flags_client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2) \
        .choices[0].message.role == "bot"
    chunks = list(flags_client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                                       stream=True))
    assert chunks[0].choices[0].delta.role == "bot"
    resp = flags_client.chat.completions.create(
        model=MODEL_NAME, messages=messages + [{"role": "assistant", "content": "Hello"}], max_tokens=2,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert resp.choices[0].message.role == "assistant"


def _wait_for_log(log_path, pattern: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        log = log_path.read_text()
        if re.search(pattern, log):
            return log
        if time.monotonic() > deadline:
            pytest.fail(f"no {pattern!r} in the server log:\n{log[-3000:]}")
        time.sleep(0.1)


def test_request_log_line_is_truncated_and_stats_are_logged(flags_server):
    url, log_path = flags_server
    prompt = "abcdefghijklmnopqrstuvwxyz " * 4
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 3},
                   headers={"X-Request-Id": "logged-1"})
    assert r.status_code == 200
    log = _wait_for_log(log_path, r"Received request cmpl-logged-1: ")
    line = next(x for x in log.splitlines() if "Received request cmpl-logged-1:" in x)
    assert f"prompt: {prompt[:MAX_LOG_LEN]!r}, " in line and "max_tokens=3" in line
    ids = json.loads(re.search(r"prompt_token_ids: (\[[0-9, ]*\])", line).group(1))
    assert len(ids) == MAX_LOG_LEN
    _wait_for_log(log_path, r"Avg prompt throughput: [0-9.]+ tokens/s, Avg generation throughput: [0-9.]+ tokens/s, "
                            r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [0-9.]+%, "
                            r"Prefix cache hit rate: [0-9.]+%")


# ---- the command line -----------------------------------------------------------------------------------
NEW_SERVE_FLAGS = {
    "--chat-template-content-format": "auto", "--response-role": "assistant", "--allowed-origins": "['*']",
    "--allowed-methods": "['*']", "--allowed-headers": "['*']", "--allow-credentials": "False",
    "--root-path": "None", "--enable-request-id-headers": "False", "--disable-log-requests": "False",
    "--max-log-len": "None", "--ssl-keyfile": "None", "--ssl-certfile": "None", "--disable-fastapi-docs": "False",
    "--enable-prompt-tokens-details": "False", "--disable-log-stats": "False", "--uvicorn-log-level": "info",
}


def _help(*argv: str) -> str:
    from pagedllm.entrypoints.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return " ".join(out.getvalue().split())  # argparse wraps lines


def test_help_lists_subcommands_and_every_serve_flag_with_its_default():
    top = _help()
    for command in ("serve", "generate", "bench"):
        assert command in top
    serve_help = _help("serve")
    serve_help = serve_help[serve_help.index("options:"):]  # past the usage line
    for flag, default in NEW_SERVE_FLAGS.items():
        match = re.search(re.escape(flag) + r"\b.*?\(default: ([^)]*)\)", serve_help)
        assert match and match.group(1) == default, (flag, match and match.group(1))
    generate_help = _help("generate")
    for flag in ("--prompt", "--chat", "--system", "--max-tokens", "--temperature", "--top-p", "--seed", "--model"):
        assert flag in generate_help
    assert "throughput" in _help("bench") and "cpu" in _help("bench")


def test_server_flags_parse_and_reach_uvicorn(tmp_path):
    from pagedllm.entrypoints.cli import frontend_args_from, make_parser, uvicorn_kwargs

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    ns = make_parser().parse_args(["serve", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                                   "--allowed-origins", '["https://a.example"]', "--allow-credentials",
                                   "--max-log-len", "5", "--chat-template-content-format", "openai"])
    args = frontend_args_from(ns)
    assert args.allowed_origins == ["https://a.example"] and args.allow_credentials and args.max_log_len == 5
    assert args.allowed_methods == ["*"] and args.chat_template_content_format == "openai"
    kwargs = uvicorn_kwargs(args)
    assert (kwargs["ssl_keyfile"], kwargs["ssl_certfile"]) == (str(key), str(cert))
    with pytest.raises(ValueError, match="ssl-certfile"):
        frontend_args_from(make_parser().parse_args(["serve", "--ssl-keyfile", str(key)]))
    with pytest.raises(ValueError, match="no such TLS file"):
        frontend_args_from(make_parser().parse_args(["serve", "--ssl-keyfile", "/nonexistent",
                                                     "--ssl-certfile", str(cert)]))
    for bad in (["--allowed-origins", "*"], ["--allowed-origins", '{"a": 1}'],
                ["--chat-template-content-format", "xml"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            make_parser().parse_args(["serve", *bad])


def test_bench_hands_the_remaining_flags_to_the_benchmark_module():
    from pagedllm.entrypoints.cli import main, make_parser

    ns = make_parser().parse_args(["bench", "cpu", "--dtype", "bfloat16", "--help"])
    assert (ns.benchmark, ns.bench_args) == ("cpu", ["--dtype", "bfloat16", "--help"])
    try:
        import pagedllm.benchmarks.throughput  # noqa: F401
    except ModuleNotFoundError:  # not moved under src/ yet: a clear error, exit status 1
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
            main(["bench", "throughput"])
        assert exit_info.value.code == 1 and "pagedllm.benchmarks.throughput" in err.getvalue()
    else:  # the module's own --help: its flags, exit status 0
        assert _help("bench", "throughput")


def test_generate_streams_the_greedy_text_of_llm_generate(tiny_models, llm):
    prompt = "The capital of France is"
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC_DIR)}
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", prompt, "--model", tiny_models["llama"],
         "--kv-cache-memory-bytes", str(TEST_KV_BYTES), "--max-tokens", "12", "--temperature", "0"],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == expected.outputs[0].text + "\n"
    assert "nanobind" not in proc.stderr  # a CPU process of the CLI does not load triton (its exit dump)


def test_generate_chat_with_a_system_message_equals_llm_chat(tiny_models, llm, capsys):
    from pagedllm.entrypoints.cli import main

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    main(["generate", "--chat", "--system", "Be brief.", "--prompt", "Name a colour.", "--model",
          tiny_models["llama"], "--kv-cache-memory-bytes", str(TEST_KV_BYTES), "--max-tokens", "8",
          "--temperature", "0"])
    assert capsys.readouterr().out == expected.outputs[0].text + "\n"
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--system", "no chat", "--prompt", "x", "--model", tiny_models["llama"]])
    assert exit_info.value.code == 1 and "--system needs --chat" in capsys.readouterr().err


def test_generate_rejects_bad_sampling_flags_before_loading_the_model(capsys, monkeypatch):
    from pagedllm.engine import llm_engine
    from pagedllm.entrypoints.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "from_engine_args", no_load)
    for flags, match in ((["--max-tokens", "-1"], "max_tokens must be"), (["--temperature", "-2"], "temperature"),
                         (["--top-p", "7"], "top_p")):
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--prompt", "x", "--model", "/nonexistent/model", *flags])
        assert exit_info.value.code == 1 and match in capsys.readouterr().err
