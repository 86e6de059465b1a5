"""What bounds one client's impact on a real `pagedllm serve`: the request body limit (413 at
once, /health unaffected), tokenization off the event loop, `n` at most max_num_seqs, and vLLM's
400 for a completion that cannot fit the context."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.test_openai_server import MODEL_NAME, _serve

BODY_LIMIT = 1_000_000
MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    return tmp_path_factory.mktemp("limits-server") / "server.log"


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("limits-server-profile")


@pytest.fixture(scope="module")
def url(tiny_models, log_path, profile_dir):
    args = ["--served-model-name", MODEL_NAME, "--disable-log-stats", "--max-request-body-bytes", str(BODY_LIMIT),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "256"]
    yield from _serve(tiny_models["llama"], log_path, args,
                      {"PAGEDLLM_API_KEY": "", "PAGEDLLM_TORCH_PROFILER_DIR": str(profile_dir)})


def _health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            assert c.get(f"{url}/health").status_code == 200
            out.append(time.monotonic() - t0)
            time.sleep(0.02)


def _while_probing_health(url: str, work) -> tuple[object, list[float]]:
    stop, latencies = threading.Event(), []
    prober = threading.Thread(target=_health_latencies, args=(url, stop, latencies))
    prober.start()
    time.sleep(0.2)
    try:
        result = work()
    finally:
        time.sleep(0.1)
        stop.set()
        prober.join()
    return result, latencies


def test_a_20mb_body_is_refused_with_413_at_once_and_health_stays_fast(url):
    big = b'{"prompt": "' + b"a" * 20_000_000 + b'", "max_tokens": 1}'

    def post():
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", content=big, headers={"Content-Type": "application/json"}, timeout=30)
        return r, time.monotonic() - t0

    (r, elapsed), latencies = _while_probing_health(url, post)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413 and "--max-request-body-bytes" in r.text
    assert elapsed < 1.0 and latencies and max(latencies) < 0.5


def test_a_chunked_body_over_the_limit_is_refused_too(url):
    def chunks():
        for _ in range(30):
            yield b"x" * 100_000

    r = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_tokenizing_a_megabyte_does_not_stall_health(url):
    text = "The quick brown fox jumps over the lazy dog. " * 21_000  # just under the body limit

    def tokenize():
        return httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=60)

    r, latencies = _while_probing_health(url, tokenize)
    assert r.status_code == 200 and r.json()["count"] > 100_000
    assert len(latencies) >= 3 and max(latencies) < 0.5, max(latencies)


def test_n_above_max_num_seqs_and_a_completion_past_the_context_are_400(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=f"n=1000 .*max_num_seqs={MAX_NUM_SEQS}") as info:
        client.completions.create(model=MODEL_NAME, prompt="hi", n=1000, max_tokens=1)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL_NAME, prompt="hi", n=2, best_of=MAX_NUM_SEQS + 1, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"maximum context length is 256 tokens\. However, you "
                                                     r"requested 1000000\d+ tokens \(\d+ in the messages, "
                                                     r"1000000000 in the completion\)") as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=10**9)
    assert info.value.body["param"] == "max_tokens"
    assert client.completions.create(model=MODEL_NAME, prompt="hi", n=MAX_NUM_SEQS, max_tokens=2).choices


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("guided_decoding_backend", "outlines"),
    ("logits_processors", ["x"]),
])
def test_fields_not_implemented_are_400_naming_them(url, field, value):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(f"{url}{path}", json=body | {"max_tokens": 2, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert f"{field} is not supported by this server yet" in r.json()["error"]["message"]


def test_unknown_fields_are_accepted_and_logged_once_per_name(url, log_path):
    for _ in range(3):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "my_custom_knob": 7})
        assert r.status_code == 200
    deadline = time.monotonic() + 5
    while "'my_custom_knob'" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert log_path.read_text().count("'my_custom_knob' is not known to this server") == 1


def test_an_image_part_error_does_not_echo_the_payload(url):
    payload = "data:image/png;base64," + "A" * 200_000
    content = [{"type": "image_url", "image_url": {"url": payload}}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and "text only" in r.text and len(r.text) < 1000


def _gauge(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def test_after_cancelled_streams_the_gauges_read_idle_within_a_second(url):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    async def start_and_cancel() -> None:
        stream = await client.completions.create(model=MODEL_NAME, prompt="count with me", max_tokens=200,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            break  # one token, then the client goes away
        await stream.close()

    async def main() -> None:
        await asyncio.gather(*(start_and_cancel() for _ in range(16)))

    asyncio.run(main())
    deadline = time.monotonic() + 1.0
    while True:
        stats = httpx.get(f"{url}/internal/stats").json()
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(0.2)
    assert _gauge(url, "pagedllm:num_requests_running") == 0
    assert _gauge(url, "pagedllm:num_requests_waiting") == 0
    assert _gauge(url, "pagedllm:kv_cache_usage_perc") == 0.0


def _counter(url: str, name: str, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("finished_reason") == reason:
                return sample.value
    return 0.0


def test_a_non_streaming_request_whose_client_leaves_is_aborted_and_frees_its_blocks(url):
    aborted = _counter(url, "pagedllm:request_success_total", "abort")
    body = {"prompt": "hi", "n": MAX_NUM_SEQS, "max_tokens": 250, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    t_left = time.monotonic()
    while True:
        stats = httpx.get(f"{url}/internal/stats").json()
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
            break
        assert time.monotonic() - t_left < 3.0, stats
        time.sleep(0.05)
    # Aborted (not run to its end): all n sequences counted with finish reason "abort".
    assert _counter(url, "pagedllm:request_success_total", "abort") - aborted == 1


SCHEMA = {"type": "object", "properties": {"mood": {"type": "string", "enum": ["happy", "sad"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["mood", "score"], "additionalProperties": False}


def test_structured_outputs_by_every_name_constrain_the_noise(url):
    """The tiny model's free output is noise: a parse that validates means the constraint worked."""
    import jsonschema

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chat = [{"role": "user", "content": "How do you feel?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "mood", "schema": SCHEMA, "strict": True}}
    # Without a whitespace bound the language is infinite (noise may pick newlines until max_tokens):
    # every reply that the grammar ended validates. With disable_any_whitespace every reply must.
    for extra, finite in (({"response_format": fmt}, False), ({"extra_body": {"guided_json": SCHEMA}}, False),
                          ({"extra_body": {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}},
                           True)):
        reply = client.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=60, n=2, **extra)
        for choice in reply.choices:
            assert choice.finish_reason == "stop" or not finite
            if choice.finish_reason == "stop":
                jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            else:  # cut by max_tokens: still a prefix that the schema's language allows
                assert _grammar_accepts_prefix(choice.message.content, schema=SCHEMA)
    reply = client.completions.create(model=MODEL_NAME, prompt="Pick:", max_tokens=10,
                                      extra_body={"guided_choice": ["left", "right"]})
    assert reply.choices[0].text in ("left", "right")
    reply = client.completions.create(model=MODEL_NAME, prompt="Code:", max_tokens=12,
                                      extra_body={"guided_regex": "[A-Z]{3}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", reply.choices[0].text)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=40,
                                           response_format={"type": "json_object"})
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # noise may stay inside one string until max_tokens: the text is still a JSON object's prefix
        assert content.lstrip().startswith("{") and _grammar_accepts_prefix(content)


def _grammar_accepts_prefix(text, schema=None):
    """Whether `text` is a prefix of some document of the JSON (schema) language, checked by xgrammar."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]))
    grammar = (compiler.compile_json_schema(json.dumps(schema)) if schema is not None
               else compiler.compile_builtin_json_grammar())
    return xgr.GrammarMatcher(grammar).accept_string(text)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense-type"}}}}, "guided_json"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_constraints_are_400_and_the_server_serves_on(url, extra, param):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in (param, None) and len(r.text) < 2000
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    stats = httpx.get(f"{url}/internal/stats").json()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_profile_routes_write_the_workers_traces(url, profile_dir):
    """vLLM's /start_profile and /stop_profile (there while PAGEDLLM_TORCH_PROFILER_DIR is set; the
    main server test module checks they are absent without it)."""
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.post("/stop_profile").status_code == 200  # none running: nothing written, serving goes on
        assert not list(profile_dir.iterdir())
        assert c.post("/start_profile").status_code == 200
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200
        assert c.post("/stop_profile").status_code == 200
        assert c.get("/health").status_code == 200
    assert (profile_dir / "rank0.txt").read_text().startswith("rank 0: ")
    assert (profile_dir / "rank0.trace.json").stat().st_size > 0
