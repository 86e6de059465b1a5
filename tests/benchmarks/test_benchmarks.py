"""Smoke runs of every benchmark's main() at tiny sizes on the CPU: the JSON lines they print
carry the figures BENCHMARKS.md asks for, and the figures agree with the workload drawn."""
from __future__ import annotations

import asyncio
import http.server
import json
import socket
import statistics
import threading

import pytest
import torch

from pagedllm.benchmarks import (
    common, cpu_vs_hf, latency, long_prompt, moe_kernel, serve, shared_prefix, startup, structured, throughput,
)
from tests.conftest import TEST_KV_BYTES, build_tiny_model

KV = f"kv_cache_memory_bytes={TEST_KV_BYTES}"


def _json_lines(capsys) -> list[dict]:
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for row in rows:
        assert {"commit", "device", "time", "benchmark"} <= row.keys()
    return rows


@pytest.mark.parametrize("shape, tp", [(shape, tp) for shape in sorted(common.SHAPES) for tp in (1, 2, 4)]
                         + [("llama3-8b", 16)])
def test_weight_bytes_equals_the_parameter_bytes_of_the_model(shape, tp, monkeypatch):
    """The roofline's weights and K/V are the model's; at TP > 1 those of one rank (the model built
    as rank 0 of ``tp``: sharded projections, experts and vocabulary, whole norms; at 16 ranks
    llama3-8b's 8 K/V heads are one per rank, replicated)."""
    import transformers

    from pagedllm.distributed import parallel_state
    from pagedllm.model.registry import get_model_class

    monkeypatch.setattr(parallel_state, "_TP_SIZE", tp)
    monkeypatch.setattr(parallel_state, "_TP_RANK", 0)
    config = transformers.AutoConfig.from_pretrained(common.write_shape(shape))
    with torch.device("meta"):
        model = get_model_class(config.architectures)(config)
    params = {id(p): p for p in model.parameters()}.values()  # a tied head counts once
    assert common.weight_bytes(common.SHAPES[shape], itemsize=2, tp=tp) == sum(p.numel() * 2 for p in params)
    attn = model.model.layers[0].self_attn
    assert common.kv_bytes_per_token(common.SHAPES[shape], 2, tp) == 2 * config.num_hidden_layers * attn.kv_size * 2


def test_a_moe_steps_roofline_counts_the_experts_its_batch_is_expected_to_pick():
    """A batch of T tokens reads each expert some token picked, once: under uniform routing
    E * (1 - (1 - k/E) ** T) experts a layer (one token: its k), which a Monte Carlo draw of
    random top-k picks matches; the step's bytes grow by those experts' weights."""
    g = torch.Generator().manual_seed(0)
    for experts, top_k, tokens in [(128, 8, 1), (128, 8, 32), (8, 2, 5)]:
        draws = [len(set(torch.rand(tokens, experts, generator=g).topk(top_k).indices.flatten().tolist()))
                 for _ in range(400)]
        assert common.expected_experts(experts, top_k, tokens) == pytest.approx(sum(draws) / len(draws), rel=0.01)
    assert common.expected_experts(128, 8, 1) == 8
    cfg = common.SHAPES["qwen3-30b-a3b"]
    expert_bytes = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2 * cfg["num_hidden_layers"]
    extra = common.step_read_bytes(cfg, 2, 32, 0) - common.step_read_bytes(cfg, 2, 1, 0) - 31 * cfg["hidden_size"] * 2
    assert extra == pytest.approx((common.expected_experts(128, 8, 32) - 8) * expert_bytes, rel=1e-6)


def test_throughput_counts_every_drawn_output_token(capsys):
    throughput.main(["--shape", "tiny-llama", "--num-prompts", "3", "--max-input-len", "16", "--max-output-len", "4",
                     "--dtype", "float32", "--engine-args", KV])
    (row,) = _json_lines(capsys)
    assert row["benchmark"] == "throughput" and row["num_prompts"] == 3
    assert row["output_tokens"] == 3 * 4  # max_tokens drawn from randint(4, 4), ignore_eos
    assert row["total_tok_s"] > row["output_tok_s"] > 0



def test_long_prompt_reports_total_and_prefill_rates_of_the_drawn_prompts(capsys):
    long_prompt.main(["--shape", "tiny-llama", "--num-prompts", "3", "--min-input-len", "40", "--max-input-len", "80",
                      "--min-output-len", "2", "--max-output-len", "3", "--dtype", "float32", "--engine-args", KV])
    (row,) = _json_lines(capsys)
    assert row["benchmark"] == "long_prompt" and row["num_prompts"] == 3
    assert 3 * 40 <= row["prompt_tokens"] <= 3 * 80 and 3 * 2 <= row["output_tokens"] <= 3 * 3
    # elapsed_s is rounded to 1 ms, a few % of a tiny run: the rate must lie within what that rounding allows.
    tokens, elapsed = row["prompt_tokens"] + row["output_tokens"], row["elapsed_s"]
    assert tokens / (elapsed + 5e-4) - 0.05 <= row["total_tok_s"] <= tokens / max(elapsed - 5e-4, 1e-9) + 0.05
    # Every prompt is prefilled before the run ends, so the prefill rate is at least the total.
    assert 0 < row["prefill_s"] <= row["elapsed_s"] and row["prefill_tok_s"] > 0
    assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p90"] <= row["ttft_ms_p99"] <= row["prefill_s"] * 1e3 + 1
    assert row["cached_prompt_tokens"] == 0  # random prompts (and the warm-up) share no block


@pytest.mark.parametrize("caching", [True, False])
def test_shared_prefix_hits_every_prefix_block_after_the_cold_request(capsys, caching):
    shared_prefix.main(["--shape", "tiny-llama", "--num-prompts", "4", "--prefix-len", "64", "--min-suffix-len", "4",
                        "--max-suffix-len", "8", "--min-output-len", "2", "--max-output-len", "2",
                        "--dtype", "float32", "--engine-args", f"{KV},enable_prefix_caching={str(caching).lower()}"])
    (row,) = _json_lines(capsys)
    assert row["benchmark"] == "shared_prefix" and row["enable_prefix_caching"] is caching
    assert 3 * (64 + 4) <= row["prompt_tokens"] <= 3 * (64 + 8) and row["output_tokens"] == 3 * 2
    # The prefix is 4 whole blocks of 16: with the cache, each of the 3 timed requests hits all of it.
    assert row["cached_prompt_tokens"] == (3 * 64 if caching else 0)
    assert row["hit_rate"] == pytest.approx(row["ideal_hit_rate"] if caching else 0.0)
    assert row["ttft_cold_ms"] > 0 and 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"]


def test_structured_compares_json_with_unconstrained_in_one_run(capsys, smollm2_tokenizer_dir):
    structured.main(["--shape", "tiny-llama", "--num-prompts", "2", "--max-input-len", "16", "--max-output-len", "24",
                     "--dtype", "float32", "--repeats", "1", "--tokenizer", smollm2_tokenizer_dir,
                     "--engine-args", KV])
    (row,) = _json_lines(capsys)
    assert row["benchmark"] == "structured" and row["backend"] == "auto"
    # The two rates are reported to 0.1 tok/s, a few tok/s on a loaded 2-core machine: a few % of rounding.
    assert row["ratio"] == pytest.approx(row["json_output_tok_s"] / row["unconstrained_output_tok_s"], rel=0.03)
    assert 0 < row["json_output_tokens"] <= 2 * 24 and row["json_valid"].endswith("/2")
    # Every request whose grammar ended is a valid record (compile errors would have raised).
    assert int(row["json_valid"].split("/")[0]) >= int(row["json_stopped"].split("/")[0])
    assert row["first_request_cold_schema_s"] > 0 and row["first_request_cached_schema_s"] > 0


def test_fp8_kv_cache_flag_doubles_the_blocks_and_counts_one_byte_per_kv_element(capsys):
    throughput.main(["--shape", "tiny-llama", "--num-prompts", "2", "--max-input-len", "8", "--max-output-len", "2",
                     "--dtype", "float32", "--kv-cache-dtype", "fp8", "--engine-args", KV])
    (row,) = _json_lines(capsys)
    assert row["kv_cache_dtype"] == "fp8" and row["output_tokens"] == 2 * 2
    assert row["num_kv_blocks"] == TEST_KV_BYTES // (16 * common.kv_bytes_per_token(common.SHAPES["tiny-llama"], 1))
    latency.main(["--shape", "tiny-llama", "--batch-sizes", "1", "--input-len", "8", "--output-len", "2",
                  "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32", "--copy-mib", "8",
                  "--kv-cache-dtype", "fp8_e5m2", "--engine-args", KV])
    (one,) = _json_lines(capsys)
    assert one["kv_cache_dtype"] == "fp8_e5m2"
    assert one["kv_bytes"] == 9 * common.kv_bytes_per_token(common.SHAPES["tiny-llama"], 1)


def test_latency_reports_each_batch_size_and_the_roofline_at_batch_1(capsys):
    latency.main(["--shape", "tiny-llama", "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "4",
                  "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32", "--copy-mib", "8",
                  "--engine-args", KV])
    rows = _json_lines(capsys)
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["benchmark"] == "latency" and r["output_len"] == 4 and r["ttft_ms"] > 0
        assert r["ms_per_step"] == pytest.approx((r["e2e_s"] * 1e3 - r["ttft_ms"]) / 3, abs=0.05)
        # decode_tok_s is reported to 0.1 (on a slow or loaded machine a few tok/s, where 0.05 is > 1%).
        assert r["decode_tok_s"] == pytest.approx(r["batch_size"] * 1e3 / r["ms_per_step"], rel=1e-2, abs=0.05)
    one, two = rows
    assert one["weight_bytes"] == common.weight_bytes(common.SHAPES["tiny-llama"], itemsize=4)
    assert one["copy_bandwidth_gb_s"] > 0
    # The K/V of the mean context (8 + 4 / 2 tokens) beside the weights, at 4 bytes (float32 cache).
    assert one["kv_bytes"] == 10 * common.kv_bytes_per_token(common.SHAPES["tiny-llama"], 4)
    assert one["roofline_ms"] == pytest.approx((one["weight_bytes"] + one["kv_bytes"]) /
                                               (one["copy_bandwidth_gb_s"] * 1e9) * 1e3, rel=0.05)
    # Both are rounded to 3 decimals: on a slow CPU the fraction is ~0.01, so compare absolutely.
    assert one["roofline_fraction"] == pytest.approx(one["roofline_ms"] / one["ms_per_step"], rel=1e-2, abs=1e-3)
    assert "roofline_fraction" not in two


def test_startup_is_timed_by_the_parent_and_broken_down_by_the_child(capsys):
    startup.main(["--shape", "tiny-llama", "--engine-args", KV])
    (row,) = _json_lines(capsys)
    assert row["benchmark"] == "startup"
    parts = row["interpreter_s"] + row["import_s"] + row["engine_init_s"] + row["first_token_s"]
    assert row["startup_s"] >= parts - 0.01  # the parent's clock runs until the token is reported
    assert row["import_s"] > 0 and row["config_s"] > 0 and row["load_s"] > 0 and row["first_token_s"] > 0
    assert row["kv_sizing_s"] is not None and row["cuda_graphs_s"] is None  # no graphs on the CPU
    assert row["precompile_s"] is None  # no Triton compiles on the CPU
    assert row["engine_other_s"] >= -0.01


def test_cpu_vs_hf_reports_both_engines_on_the_same_prompts(smollm2_tokenizer_dir, tmp_path, capsys):
    # A tiny model with SmolLM2's tokenizer and chat template: the real GGUF's first parse alone
    # would take most of this file's time budget.
    model = build_tiny_model("llama", str(tmp_path), smollm2_tokenizer_dir)
    cpu_vs_hf.main(["--model", model, "--num-requests", "3", "--max-tokens", "4", "--max-model-len", "256",
                    "--kv-cache-memory-bytes", str(TEST_KV_BYTES)])
    (row,) = _json_lines(capsys)
    assert row["benchmark"] == "cpu_vs_hf" and row["num_requests"] == 3 and row["model"] == model
    for engine in ("pagedllm", "hf"):  # elapsed_s is rounded to 10 ms
        # output_tok_s is reported to 0.1: a few tok/s on a loaded machine, so allow its rounding (2%).
        assert 3 * 4 / row[f"{engine}_output_tok_s"] == pytest.approx(row[f"{engine}_elapsed_s"], abs=0.006, rel=0.02)
    assert row["speedup"] == pytest.approx(row["pagedllm_output_tok_s"] / row["hf_output_tok_s"], rel=0.02,
                                           abs=0.005)  # reported to 2 decimals


def test_cpu_vs_hf_exports_the_weights_vllm_reads(smollm2_tokenizer_dir, tmp_path):
    """The folder written for the vLLM peer holds the model transformers had in memory: reloaded,
    the same logits; written once (a second call neither loads the model nor touches the file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = build_tiny_model("llama", str(tmp_path / "src"), smollm2_tokenizer_dir, tie_word_embeddings=True)
    model = cpu_vs_hf._load_hf(source, "float32")
    tok = AutoTokenizer.from_pretrained(source)
    out = cpu_vs_hf.export_hf_folder(lambda: model, tok, str(tmp_path / "export"))
    weights = tmp_path / "export" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert again.config.architectures == ["LlamaForCausalLM"]
    ids = torch.tensor([tok.encode("Write a short story about item 3")])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    assert AutoTokenizer.from_pretrained(out).encode("item 3") == tok.encode("item 3")
    assert cpu_vs_hf.export_hf_folder(pytest.fail, tok, out) == out and weights.stat().st_mtime_ns == stamp


def test_cpu_vs_hf_vllm_peer_failure_names_the_interpreter(tmp_path):
    import importlib.util
    import sys
    from types import SimpleNamespace

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has vllm: the peer would run")
    args = SimpleNamespace(dtype="float32", max_model_len=64, max_tokens=2, temperature=0.0,
                           kv_cache_memory_bytes=1 << 30)
    with pytest.raises(RuntimeError, match=r"(?s)--vllm-python .*No module named 'vllm'"):
        cpu_vs_hf.run_vllm_peer(sys.executable, str(tmp_path), [[1, 2, 3]], args)


def test_serve_draw_follows_benchmarks_md():
    requests, gaps = serve.draw_workload(3, 4.0)
    import random

    rng = random.Random(1)
    for req in requests:
        n = rng.randint(100, 1024)
        assert req.prompt_token_ids == [rng.randint(100, 40000) for _ in range(n)]
        assert req.max_tokens == rng.randint(100, 1024)
    assert gaps == [rng.expovariate(4.0) for _ in range(3)]


def test_serve_launches_a_server_and_measures_every_streamed_token(smollm2_tokenizer_dir, capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    num, max_in, max_out = 8, 24, 4
    serve.main(["--launch", "--shape", "tiny-llama", "--tokenizer", smollm2_tokenizer_dir,
                "--base-url", f"http://127.0.0.1:{port}", "--http-client", "stdlib", "--request-rate", "200",
                "--num-prompts", str(num), "--max-input-len", str(max_in), "--max-output-len", str(max_out),
                "--server-args", f"--dtype float32 --max-model-len 64 --kv-cache-memory-bytes {TEST_KV_BYTES} "
                                 "--uvicorn-log-level warning"])
    (row,) = _json_lines(capsys)
    requests, _ = serve.draw_workload(num, 200.0, max_in, max_out)
    assert row["benchmark"] == "serve" and row["engine"] == "pagedllm" and row["http_client"] == "stdlib"
    assert row["healthy_s"] > 0
    assert (row["completed"], row["errors"], row["short_outputs"]) == (num, 0, 0), row["error_samples"]
    assert row["output_tokens"] == sum(r.max_tokens for r in requests)
    for metric in ("ttft", "tpot", "itl"):
        p50, p90, p99 = (row[f"{metric}_ms_p{q}"] for q in serve.PERCENTILES)
        assert 0 < p50 <= p90 <= p99
    assert row["output_tokens"] / row["output_tok_s"] == pytest.approx(row["duration_s"], abs=0.006, rel=0.02)


class _FakeCompletions(http.server.BaseHTTPRequestHandler):
    """max_tokens picks the answer: 1 → HTTP 400, 2 → an SSE error event, else that many tokens."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["max_tokens"]
        if n == 1:
            payload = b'{"error": {"message": "bad request"}}'
            self.send_response(400)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self.path == "/v1/chat/completions":  # the role first, then one content delta per token
            assert body["messages"] and "prompt" not in body
            events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]}] + [
                {"choices": [{"delta": {"content": f"t{i}"}}]} for i in range(n)] + [
                {"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": 7}}]
        else:
            assert self.path == "/v1/completions" and "messages" not in body
            events = ([{"error": {"message": "engine died"}}] if n == 2 else
                      [{"choices": [{"text": f"t{i}"}]} for i in range(n)] + [{"choices": [], "usage": {
                          "completion_tokens": n}}])
        for event in [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]:
            for piece in (event[:7], event[7:]):  # lines split across chunks
                self.wfile.write(f"{len(piece):x}\r\n{piece}\r\n".encode())
        self.wfile.write(b"0\r\n\r\n")


@pytest.mark.parametrize("client", ["stdlib", "httpx"])
def test_serve_client_parses_chunked_streams_and_counts_errors(client):
    if client == "httpx":
        pytest.importorskip("httpx")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"

    async def run():
        lines_of = serve._stdlib_lines
        if client == "httpx":
            import httpx

            http_client = httpx.AsyncClient()
            lines_of = lambda u, b, h: serve._httpx_lines(http_client, u, b, h)  # noqa: E731
        results = [await serve.send_request(lines_of, url, "m", serve.BenchRequest([5, 6], n), {}, 10)
                   for n in (5, 1, 2)]
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1/completions"
        results.append(await serve.send_request(lines_of, dead, "m", serve.BenchRequest([5], 3), {}, 10))
        chats, _ = serve.draw_chats(1, 2.0, max_tokens=4)
        results.append(await serve.send_request(lines_of, url, "m", chats[0], {}, 10))
        if client == "httpx":
            await http_client.aclose()
        return results

    try:
        good, http_400, stream_error, refused, chat = asyncio.run(run())
    finally:
        server.shutdown()
    assert good.ok and good.output_tokens == 5 and len(good.itl_s) == 4 and 0 < good.ttft_s <= good.latency_s
    # a chat: the role chunk is not the first token (4 content chunks: 3 gaps), the prompt counted by the server
    assert chat.ok and chat.output_tokens == 4 and len(chat.itl_s) == 3 and chat.prompt_tokens == 7
    assert serve.summarize(serve.draw_chats(1, 2.0, max_tokens=4)[0], [chat], duration_s=1.0)["total_tok_s"] == 11.0
    assert not http_400.ok and "HTTP 400" in http_400.error and "bad request" in http_400.error
    assert not stream_error.ok and "engine died" in stream_error.error
    assert not refused.ok and refused.error
    summary = serve.summarize([serve.BenchRequest([5, 6], n) for n in (5, 1, 2, 3)],
                              [good, http_400, stream_error, refused], duration_s=1.0)
    assert (summary["completed"], summary["errors"], summary["output_tokens"]) == (1, 3, 5)
    assert summary["tpot_ms_p50"] == pytest.approx((good.latency_s - good.ttft_s) / 4 * 1e3, abs=0.01)
    assert summary["itl_ms_p50"] == pytest.approx(statistics.median(good.itl_s) * 1e3, abs=0.01)


def test_moe_kernel_times_the_torch_paths_on_cpu_and_tune_table_merges(capsys, tmp_path):
    moe_kernel.main(["--tiny", "--tokens", "1,32"])
    rows = _json_lines(capsys)
    assert [r["num_tokens"] for r in rows] == [1, 32]
    for row in rows:
        assert row["benchmark"] == "moe_kernel" and row["shape"] == "tiny-qwen3-moe" and row["top_k"] == 4
        assert row["torch_ms"] > 0 and row["bmm_loop_ms"] > 0 and "triton_ms" not in row  # no CUDA here
    for fmt in ("fp8", "int4"):  # quantized experts: the torch path over the packed weights, no bmm loop
        moe_kernel.main(["--tiny", "--tokens", "3", "--weight-format", fmt])
        (row,) = _json_lines(capsys)
        assert row["weight_format"] == fmt and row["torch_ms"] > 0 and "bmm_loop_ms" not in row
    # --tune's grid: row tiles no taller than 4x an expert's run; 256-deep K tiles for per-channel fp8 only.
    assert {c["BLOCK_M"] for c in moe_kernel.tune_grid(32, 8, 128, "")} == {16}
    assert {c["BLOCK_M"] for c in moe_kernel.tune_grid(256, 8, 128, "int4")} == {16, 32, 64}
    assert max(c["BLOCK_K"] for c in moe_kernel.tune_grid(1, 8, 128, "fp8")) == 256
    assert max(c["BLOCK_K"] for c in moe_kernel.tune_grid(1, 8, 128, "fp8-block")) == 128
    # a pick is written only when it beats the bucket's tile by the margin (stop 47: a level pick at 2,048 tokens)
    assert moe_kernel.keeps_pick(3.335, 2.875) and not moe_kernel.keeps_pick(1.843, 1.863)
    assert not moe_kernel.keeps_pick(1.0, 0.99) and moe_kernel.keeps_pick(1.0, 0.97)
    table = tmp_path / "configs.json"
    table.write_text('{"E=8,H=64,I=32": {"1": {"BLOCK_M": 16}}}')
    moe_kernel._write_table(str(table), "E=8,H=64,I=32", {32: {"BLOCK_M": 32}})
    moe_kernel._write_table(str(table), "E=16,H=64,I=32", {1: {"BLOCK_M": 64}})
    assert json.loads(table.read_text()) == {"E=8,H=64,I=32": {"1": {"BLOCK_M": 16}, "32": {"BLOCK_M": 32}},
                                             "E=16,H=64,I=32": {"1": {"BLOCK_M": 64}}}
