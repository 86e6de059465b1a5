"""Workload 3: serving — a client against an OpenAI-compatible server (docs/benchmarks.md).

For each --request-rate (4 and 16 by default, one after the other), a fresh random.Random(1)
draws per request a prompt of randint(100, 1024) token ids from randint(100, 40000) and a
max_tokens of randint(100, 1024), then one arrival gap per request (expovariate(rate):
Poisson arrivals; request i is sent at the sum of the first i gaps). Each request is a
streaming /v1/completions call with the token ids as prompt, temperature 0 and ignore_eos.
One short warm-up request goes first. --chat (workload 6, CPU serving) sends streamed
/v1/chat/completions instead: request i is workload 5's chat ("Write a short story about item
i"), asking for --max-output-len tokens; the gaps are drawn the same way.

Per request: TTFT = first chunk carrying a choice (not a chat's opening role-only chunk);
ITL = gaps between such chunks; TPOT = (latency - TTFT) / (output tokens - 1); output tokens
from the final usage chunk (stream_options.include_usage). Reported per rate: request throughput, output and total
tokens/s over the run's wall time (first send to last response), TTFT/TPOT/ITL mean, p50,
p90, p99 in ms, errors (HTTP or stream errors) and short outputs (fewer tokens than asked).

--launch starts `pagedllm serve` itself on --base-url's host and port: the --shape body
(llama3-8b by default) with vocab_size 49152, bos 1, eos 2 and the tokenizer files of
--tokenizer (SmolLM2's), and reports the seconds until /health answered 200.

The client is httpx when importable, else a small asyncio HTTP/1.1 client from the standard
library (--http-client picks one), so it runs where only the offline stack is installed.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedllm.benchmarks.common import SHAPES, emit, float_list, percentile, print_table, story_chat, write_shape

SERVE_VOCAB_SIZE = 49152  # SmolLM2's tokenizer
PERCENTILES = (50, 90, 99)


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    messages: list[dict] | None = None  # a chat (/v1/chat/completions) instead of token ids


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0  # the server's count (usage), for chats


def draw_workload(num_prompts: int, request_rate: float, max_input_len: int = 1024, max_output_len: int = 1024,
                  seed: int = 1) -> tuple[list[BenchRequest], list[float]]:
    """BENCHMARKS.md's draw: per request the prompt length, its ids, max_tokens; then the gaps."""
    rng = random.Random(seed)
    lo_in, lo_out = min(100, max_input_len), min(100, max_output_len)
    requests = []
    for _ in range(num_prompts):
        prompt = [rng.randint(100, 40000) for _ in range(rng.randint(lo_in, max_input_len))]
        requests.append(BenchRequest(prompt, rng.randint(lo_out, max_output_len)))
    gaps_s = [rng.expovariate(request_rate) for _ in range(num_prompts)]
    return requests, gaps_s


def draw_chats(num_prompts: int, request_rate: float, max_tokens: int = 128,
               seed: int = 1) -> tuple[list[BenchRequest], list[float]]:
    """Workload 6's chats (BENCHMARKS.md): workload 5's user message for request i, each asking for
    ``max_tokens``; Poisson gaps drawn as draw_workload draws them."""
    rng = random.Random(seed)
    requests = [BenchRequest([], max_tokens, story_chat(i)) for i in range(num_prompts)]
    return requests, [rng.expovariate(request_rate) for _ in range(num_prompts)]


# --- HTTP: an async iterator of response body lines, from httpx or from asyncio streams ----------

class HTTPStatusError(Exception):
    pass


async def _httpx_lines(client, url: str, body: dict, headers: dict) -> AsyncIterator[str]:
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise HTTPStatusError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            yield line


async def _stdlib_lines(url: str, body: dict, headers: dict) -> AsyncIterator[str]:
    """POST over one HTTP/1.1 connection (Connection: close); chunked or plain body, split into lines."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=parts.scheme == "https" or None)
    try:
        payload = json.dumps(body).encode()
        head = [f"POST {parts.path or '/'} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json",
                f"Content-Length: {len(payload)}", "Accept: text/event-stream", "Connection: close",
                *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status_line = (await reader.readline()).decode("latin-1")
        status = int(status_line.split()[1]) if len(status_line.split()) > 1 else 0
        resp_headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            resp_headers[k.strip().lower()] = v.strip()
        chunked = "chunked" in resp_headers.get("transfer-encoding", "").lower()
        if status != 200:
            raise HTTPStatusError(f"HTTP {status}: {(await _read_body(reader, chunked, resp_headers))[:300]!r}")
        buffer = b""
        async for data in _body_pieces(reader, chunked, resp_headers):
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if buffer:
            yield buffer.rstrip(b"\r").decode()
    finally:
        writer.close()


async def _body_pieces(reader: asyncio.StreamReader, chunked: bool, headers: dict) -> AsyncIterator[bytes]:
    if not chunked:
        if "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:
            while data := await reader.read(65536):
                yield data
        return
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after each chunk


async def _read_body(reader: asyncio.StreamReader, chunked: bool, headers: dict) -> bytes:
    return b"".join([piece async for piece in _body_pieces(reader, chunked, headers)])


def pick_http_client(name: str) -> str:
    if name != "auto":
        return name
    try:
        import httpx  # noqa: F401
    except ImportError:
        return "stdlib"
    return "httpx"


# --- one request, one run -------------------------------------------------------------------------

async def send_request(lines_of, url: str, model: str, req: BenchRequest, headers: dict,
                       timeout_s: float) -> RequestResult:
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            **({"messages": req.messages} if req.messages else {"prompt": req.prompt_token_ids})}
    url = url.replace("/v1/completions", "/v1/chat/completions") if req.messages else url
    result, chunks = RequestResult(), 0
    start = last = time.perf_counter()

    async def consume() -> None:
        nonlocal last, chunks
        async with contextlib.aclosing(lines_of(url, body, headers)) as lines:
            async for line in lines:
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise HTTPStatusError(f"stream error: {event['error']}")
                now = time.perf_counter()
                delta = (event.get("choices") or [{}])[0].get("delta") or {}
                # a chat stream opens with the reply's role and no content: not a token
                if event.get("choices") and not ("role" in delta and not delta.get("content")):
                    if chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    chunks += 1
                    last = now
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    result.prompt_tokens = event["usage"].get("prompt_tokens") or 0

    try:
        await asyncio.wait_for(consume(), timeout_s)
        result.latency_s = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        if not result.ok:
            result.error = "no tokens streamed"
    except Exception as e:  # a failed request is a figure of the run, not the end of it
        result.error = f"{type(e).__name__}: {e}"[:300]
    return result


async def run_rate(lines_of, url: str, model: str, requests: list[BenchRequest], gaps_s: list[float],
                   headers: dict, timeout_s: float) -> tuple[list[RequestResult], float]:
    tasks = []
    start = time.perf_counter()
    next_send = start
    for req, gap in zip(requests, gaps_s):
        delay = next_send - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send_request(lines_of, url, model, req, headers, timeout_s)))
        next_send += gap
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(requests: list[BenchRequest], results: list[RequestResult], duration_s: float) -> dict:
    done = [(q, r) for q, r in zip(requests, results) if r.ok]
    out_tokens = sum(r.output_tokens for _, r in done)
    in_tokens = sum(len(q.prompt_token_ids) or r.prompt_tokens for q, r in done)
    series = {
        "ttft": [r.ttft_s for _, r in done],
        "tpot": [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for _, r in done if r.output_tokens > 1],
        "itl": [gap for _, r in done for gap in r.itl_s],
    }
    summary = {
        "completed": len(done), "errors": len(results) - len(done),
        "short_outputs": sum(r.output_tokens < q.max_tokens for q, r in done),
        "duration_s": round(duration_s, 2), "output_tokens": out_tokens,
        "request_throughput": round(len(done) / duration_s, 3),
        "output_tok_s": round(out_tokens / duration_s, 1),
        "total_tok_s": round((in_tokens + out_tokens) / duration_s, 1),
    }
    for name, values in series.items():
        summary[f"{name}_ms_mean"] = round(sum(values) / len(values) * 1e3, 2) if values else None
        for q in PERCENTILES:
            summary[f"{name}_ms_p{q}"] = round(percentile(values, q) * 1e3, 2) if values else None
    summary["error_samples"] = sorted({r.error for r in results if not r.ok})[:3]
    return summary


async def _run_all(args, base_url: str, model: str) -> list[dict]:
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client_name = pick_http_client(args.http_client)
    client = None
    if client_name == "httpx":
        import httpx

        # No pool limit: a queue in the client would show up as server TTFT.
        client = httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s),
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

        def lines_of(u, body, hdrs):
            return _httpx_lines(client, u, body, hdrs)
    else:
        lines_of = _stdlib_lines
    summaries = []
    try:
        for rate in args.request_rate:
            requests, gaps_s = draw_chats(args.num_prompts, rate, args.max_output_len, args.seed) if args.chat else \
                draw_workload(args.num_prompts, rate, args.max_input_len, args.max_output_len, args.seed)
            warm = await send_request(lines_of, url, model, dataclasses.replace(requests[0], max_tokens=8), headers,
                                      args.request_timeout_s)
            if not warm.ok:
                raise RuntimeError(f"the warm-up request to {url} failed: {warm.error}")
            results, duration_s = await run_rate(lines_of, url, model, requests, gaps_s, headers,
                                                 args.request_timeout_s)
            summaries.append({"request_rate": rate, "num_prompts": args.num_prompts, "http_client": client_name,
                              "api": "chat" if args.chat else "completions",
                              **summarize(requests, results, duration_s)})
    finally:
        if client is not None:
            await client.aclose()
    return summaries


# --- launching a server ---------------------------------------------------------------------------

def _get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def _served_model(base_url: str, model: str | None) -> tuple[str, str | None]:
    """The served model's name (``model`` if given, else the server's first) and the server's engine
    (its ``owned_by``: vLLM says "vllm"; None where /v1/models does not answer and ``model`` is given)."""
    try:
        status, body = _get(f"{base_url}/v1/models", timeout_s=30)
    except OSError as e:
        status, body = f"no answer ({e})", b""
    if status != 200:
        if model is None:
            raise RuntimeError(f"GET {base_url}/v1/models: {status}; pass --model")
        return model, None
    first = json.loads(body)["data"][0]
    return model or first["id"], first.get("owned_by")


def launch_server(args, host: str, port: int) -> tuple[subprocess.Popen, float, str]:
    """Start `pagedllm serve` on the benchmark model; return (process, seconds until healthy, log path)."""
    if not args.tokenizer:
        raise ValueError("--launch needs --tokenizer DIR (SmolLM2's tokenizer files)")
    model_dir = write_shape(args.shape, tokenizer_dir=args.tokenizer, vocab_size=SERVE_VOCAB_SIZE,
                            bos_token_id=1, eos_token_id=2)
    import pagedllm

    src_dir = os.path.dirname(os.path.dirname(os.path.abspath(pagedllm.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src_dir, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model_dir, "--host", host, "--port", str(port),
           "--served-model-name", args.model, "--load-format", "dummy", *shlex.split(args.server_args)]
    log_path = args.server_log or tempfile.mkstemp(prefix="pagedllm-serve-", suffix=".log")[1]
    print(f"launching: {shlex.join(cmd)} (log: {log_path})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://{host}:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy:\n"
                               f"{open(log_path).read()[-3000:]}")
        try:
            if _get(f"{base_url}/health")[0] == 200:
                return proc, time.perf_counter() - start, log_path
        except OSError:
            pass
        if time.perf_counter() - start > args.launch_timeout_s:
            stop_server(proc)
            raise RuntimeError(f"the server was not healthy after {args.launch_timeout_s} s; log: {log_path}")
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # a clean shutdown takes the engine core process with it
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the served model name (default: the server's first model; "
                                                  "with --launch: pagedllm-bench)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--request-rate", type=float_list, default=[4.0, 16.0], help="requests/s, comma-separated")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-timeout-s", type=float, default=1800)
    p.add_argument("--http-client", choices=["auto", "httpx", "stdlib"], default="auto")
    p.add_argument("--chat", action="store_true",
                   help="workload 6: chats of workload 5's user message, --max-output-len tokens each, instead of "
                        "random token ids (--max-input-len unused)")
    p.add_argument("--launch", action="store_true", help="start `pagedllm serve` on --base-url's host and port")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="with --launch: the model body")
    p.add_argument("--tokenizer", help="with --launch: a folder of tokenizer files (SmolLM2's)")
    p.add_argument("--server-args", default="", help="with --launch: extra `pagedllm serve` flags, one string")
    p.add_argument("--server-log", default=None, help="with --launch: the server's log file (default: a temp file)")
    p.add_argument("--launch-timeout-s", type=float, default=1800)
    args = p.parse_args(argv)
    if args.num_prompts < 1 or not args.request_rate or min(args.request_rate) <= 0:
        raise ValueError(f"--num-prompts must be >= 1 and --request-rate positive, got {args.num_prompts} and "
                         f"{args.request_rate}")

    base_url = args.base_url.rstrip("/")
    proc, healthy_s = None, None
    if args.launch:
        parts = urllib.parse.urlsplit(base_url)
        args.model = args.model or "pagedllm-bench"
        proc, healthy_s, _ = launch_server(args, parts.hostname, parts.port or 80)
    engine = "pagedllm" if args.launch else None
    try:
        if not args.launch:
            args.model, engine = _served_model(base_url, args.model)
        summaries = asyncio.run(_run_all(args, base_url, args.model))
    finally:
        if proc is not None:
            stop_server(proc)
    shape = f"{args.shape} (vocab {SERVE_VOCAB_SIZE})" if args.launch else args.model
    for summary in summaries:
        emit({"benchmark": "serve", "engine": engine, "model": shape,
              "healthy_s": None if healthy_s is None else round(healthy_s, 1), **summary})
    print_table(summaries, ["request_rate", "completed", "errors", "request_throughput", "output_tok_s",
                            "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99",
                            "itl_ms_p50", "itl_ms_p90", "itl_ms_p99"])


if __name__ == "__main__":
    main()
