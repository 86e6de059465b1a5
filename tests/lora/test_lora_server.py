"""LoRA on a real `pagedllm serve` (official `openai` client): adapters from --lora-modules and
loaded at runtime are listed with their parent, picked by `model`, unloaded; bad ones are
400/404 with OpenAI error bodies while the server serves on."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import TEST_KV_BYTES
from pagedllm import LLM, LoRARequest, SamplingParams
from tests.entrypoints.test_openai_server import MODEL_NAME, _serve
from tests.lora.test_lora import _make_adapter

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def lora_dirs(tiny_models, tmp_path_factory):
    base = tiny_models["llama"]
    return {name: _make_adapter(base, str(tmp_path_factory.mktemp(f"srv-{name}")), rank, 2 * rank, targets, False, seed)
            for name, rank, targets, seed in (("alpha", 8, ["q_proj", "v_proj", "down_proj"], 1),
                                              ("beta", 16, ["o_proj", "up_proj"], 2))}


@pytest.fixture(scope="module")
def url(tiny_models, lora_dirs, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("lora-server") / "server.log"
    yield from _serve(tiny_models["llama"], log_path,
                      ["--served-model-name", MODEL_NAME, "--disable-log-stats", "--enable-lora", "--max-lora-rank", "16",
                       "--max-loras", "2", "--lora-modules", f"alpha={lora_dirs['alpha']}"],
                      {"PAGEDLLM_API_KEY": "", "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})


@pytest.fixture(scope="module")
def offline(tiny_models, lora_dirs):
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES,
              enable_lora=True, max_lora_rank=16, max_loras=2, max_model_len=256)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    texts = {None: llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].text}
    for i, name in enumerate(lora_dirs):
        texts[name] = llm.generate(PROMPT, sp, use_tqdm=False,
                                   lora_request=LoRARequest(name, i + 1, lora_dirs[name]))[0].outputs[0].text
    return texts


def test_adapters_are_listed_picked_by_model_loaded_and_unloaded_at_runtime(url, lora_dirs, offline):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL_NAME, "alpha"} and cards["alpha"].parent == MODEL_NAME

    def complete(model):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert complete(MODEL_NAME) == offline[None]
    assert complete("alpha") == offline["alpha"] != offline[None]
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": lora_dirs["beta"]})
    assert r.status_code == 200, r.text
    assert complete("beta") == offline["beta"] != offline["alpha"]
    assert {m.id for m in client.models.list().data} == {MODEL_NAME, "alpha", "beta"}
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "beta"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="`beta` does not exist"):
        complete("beta")


@pytest.mark.parametrize("body, status, match", [
    ({"lora_name": "gamma", "lora_path": "/no/such/adapter"}, 400, "is not a folder"),
    ({"lora_name": "alpha", "lora_path": "/tmp"}, 400, "already in use"),
    ({"lora_name": ""}, 400, "lora_name"),
])
def test_bad_adapters_are_refused_and_the_server_serves_on(url, body, status, match):
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
    assert r.status_code == status and match in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    ok = httpx.post(f"{url}/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    stats = httpx.get(f"{url}/internal/stats").json()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
