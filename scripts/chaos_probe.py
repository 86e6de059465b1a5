"""Reliability probe of a running `pagedllm serve` (loopback only): many concurrent streams, some
cancelled mid-way, interleaved with malformed and hostile requests; then it waits for the engine
to go idle and reports streams done / cancelled, the HTTP status counts, 5xx, and whether every
KV block is free again. Bounded in count and time.

    python scripts/chaos_probe.py --url http://127.0.0.1:8000 [--streams 64] [--bad 400] [--api-key KEY]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import json
import random
import time
from urllib.parse import urlparse

import httpx

BAD_BODIES = [
    {"prompt": "hi", "max_tokens": -1}, {"prompt": "hi", "n": 10_000}, {"prompt": "hi", "temperature": "hot"},
    {"prompt": "hi", "max_tokens": 10**9}, {"prompt": [], "max_tokens": 1}, {"prompt": [[-5]], "max_tokens": 1},
    {"prompt": "hi", "logprobs": 10**6}, {"prompt": "hi", "stop": [""]}, {"prompt": "hi", "seed": 2**70},
    {"prompt": "hi", "logit_bias": {"x": 1}}, {"prompt": "hi", "guided_json": {"type": "object"}},
    {"prompt": "hi", "response_format": {"type": "json_object"}}, {"prompt": "hi", "top_p": 0},
    {"prompt": "hi", "model": "no-such-model"}, {"prompt": None}, {}, {"prompt": "hi", "best_of": 1000},
]
BAD_CHATS = [
    {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:," + "A" * 50_000}}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto", "tools": [{"type": "function",
                                                                                       "function": {"name": "f"}}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9},
]


async def stream_one(client: httpx.AsyncClient, i: int, cancel_after: int | None, counts: collections.Counter) -> None:
    body = {"messages": [{"role": "user", "content": f"Tell me a story about item {i}."}], "max_tokens": 64,
            "stream": True}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            counts[f"stream_{r.status_code}"] += 1
            events = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if '"error"' in line:
                        counts["stream_error_events"] += 1
                    if cancel_after is not None and events >= cancel_after:
                        counts["streams_cancelled"] += 1
                        return
            counts["streams_done"] += 1
    except httpx.HTTPError as e:
        counts[f"stream_exception_{type(e).__name__}"] += 1


async def bad_one(client: httpx.AsyncClient, rng: random.Random, counts: collections.Counter) -> None:
    kind = rng.random()
    try:
        if kind < 0.45:
            r = await client.post("/v1/completions", json=rng.choice(BAD_BODIES))
        elif kind < 0.75:
            r = await client.post("/v1/chat/completions", json=rng.choice(BAD_CHATS))
        elif kind < 0.9:  # not JSON at all, or truncated JSON
            r = await client.post("/v1/completions", content=rng.choice([b"{", b"\xff\xfe", b"[1, 2", b"null"]),
                                  headers={"Content-Type": "application/json"})
        else:
            r = await client.request(rng.choice(["GET", "DELETE", "PUT"]), rng.choice(
                ["/v1/completions", "/v1/nope", "/tokenize", "/../etc/passwd"]))
        counts[f"bad_{r.status_code}"] += 1
    except httpx.HTTPError as e:
        counts[f"bad_exception_{type(e).__name__}"] += 1


async def main(args: argparse.Namespace) -> dict:
    host = urlparse(args.url).hostname or ""
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit(f"refusing a non-loopback target {host!r}: this probe only drives a local server")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    counts: collections.Counter = collections.Counter()
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=args.streams + 16)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout_s, limits=limits) as client:
        t0 = time.monotonic()
        streams = [stream_one(client, i, rng.randint(1, 8) if rng.random() < args.cancel_fraction else None, counts)
                   for i in range(args.streams)]
        bad = [bad_one(client, rng, counts) for _ in range(args.bad)]
        await asyncio.wait_for(asyncio.gather(*streams, *bad), timeout=args.timeout_s)
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 30
        while True:  # the engine should go idle with every block free
            stats = (await client.get("/internal/stats")).json()
            idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
            if idle and stats["num_free_blocks"] == stats["num_blocks"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        healthy = (await client.get("/health")).status_code == 200
    five_xx = sum(v for k, v in counts.items() if k.split("_")[-1].startswith("5"))
    return {"probe": "chaos", "elapsed_s": round(elapsed, 1), "streams": args.streams,
            "streams_done": counts["streams_done"], "streams_cancelled": counts["streams_cancelled"],
            "bad_requests": args.bad, "status_counts": dict(sorted(counts.items())), "5xx": five_xx,
            "kv_blocks_free_after": f"{stats['num_free_blocks']}/{stats['num_blocks']}",
            "running_after": stats["num_running"], "healthy_after": healthy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--cancel-fraction", type=float, default=0.5)
    parser.add_argument("--bad", type=int, default=400)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
