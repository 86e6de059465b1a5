"""Speculative decoding with an EAGLE-1 head, written here in the published layout (safetensors
+ config.json). Its proposals equal a plain-torch forward of that layout (written below from the
layout, not from pagedllm's classes) over the target's hidden states from transformers; greedy
outputs are the plain engine's with chunked prefill, preemption and prefix hits; a head that is
exact for a target built to be predictable accepts everything; sampled runs keep the target's
distribution; bad configs are refused naming the key."""
from __future__ import annotations

import collections
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.conftest import TEST_KV_BYTES, _tiny_config
from tests.engine.test_correctness import mixed_prompts

HIDDEN, HEADS, KV_HEADS, INTER, EPS, THETA = 64, 4, 2, 128, 1e-6, 10000.0
PROMPTS = mixed_prompts(6)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def write_head(out_dir: str, target: str, *, input_norm: bool, fc_bias: bool, seed: int = 3,
               hidden: int = HIDDEN, weights: dict | None = None) -> str:
    """An EAGLE-1 head as the published checkpoints store it (random weights unless given)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    head_dim = hidden // HEADS
    w = {"fc.weight": rnd(hidden, 2 * hidden, std=0.15),
         "layers.0.self_attn.q_proj.weight": rnd(HEADS * head_dim, hidden),
         "layers.0.self_attn.k_proj.weight": rnd(KV_HEADS * head_dim, hidden),
         "layers.0.self_attn.v_proj.weight": rnd(KV_HEADS * head_dim, hidden),
         "layers.0.self_attn.o_proj.weight": rnd(hidden, HEADS * head_dim),
         "layers.0.mlp.gate_proj.weight": rnd(INTER, hidden),
         "layers.0.mlp.up_proj.weight": rnd(INTER, hidden),
         "layers.0.mlp.down_proj.weight": rnd(hidden, INTER),
         "layers.0.post_attention_layernorm.weight": 1 + rnd(hidden, std=0.1)}
    if fc_bias:
        w["fc.bias"] = rnd(hidden, std=0.1)
    if input_norm:
        w["layers.0.input_layernorm.weight"] = 1 + rnd(hidden, std=0.1)
    w.update(weights or {})
    target_weights = load_file(os.path.join(target, "model.safetensors"))
    w["embed_tokens.weight"] = target_weights["model.embed_tokens.weight"]  # the published heads carry a copy
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(target, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    config = {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "vocab_size": vocab, "rms_norm_eps": EPS, "rope_theta": THETA,
              "max_position_embeddings": 512, "hidden_act": "silu", "tie_word_embeddings": False,
              "bias": fc_bias, "torch_dtype": "float32"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


# ---- the independent reference: the published layout in plain torch ------------------------------
def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, positions):  # x [T, heads, d], HF's rotate-half convention
    d = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_head(w: dict, embed: torch.Tensor, lm_head: torch.Tensor, ids: list[int], feats: torch.Tensor):
    """Rows p = 0..T-1 with inputs (embed(ids[p]), feats[p]) at positions p, causal: [T, hidden]."""
    x = torch.cat([embed[torch.tensor(ids)], feats], -1) @ w["fc.weight"].T
    if "fc.bias" in w:
        x = x + w["fc.bias"]
    h = _rms(x, w["layers.0.input_layernorm.weight"]) if "layers.0.input_layernorm.weight" in w else x
    return reference_layer(w, "layers.0.", h, x)


def reference_layer(w: dict, prefix: str, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The head's one Llama decoder layer (tensors ``prefix``*): causal attention over ``h`` at
    positions 0..T-1 added to ``residual``, then the post-attention norm and the MLP: [T, hidden]."""
    T, d = h.shape[0], HIDDEN // HEADS
    pos = torch.arange(T)
    q = _rope((h @ w[prefix + "self_attn.q_proj.weight"].T).view(T, HEADS, d), pos)
    k = _rope((h @ w[prefix + "self_attn.k_proj.weight"].T).view(T, KV_HEADS, d), pos)
    v = (h @ w[prefix + "self_attn.v_proj.weight"].T).view(T, KV_HEADS, d)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    x = residual + o.transpose(0, 1).reshape(T, -1) @ w[prefix + "self_attn.o_proj.weight"].T
    m = _rms(x, w[prefix + "post_attention_layernorm.weight"])
    m = F.silu(m @ w[prefix + "mlp.gate_proj.weight"].T) * (m @ w[prefix + "mlp.up_proj.weight"].T)
    return x + m @ w[prefix + "mlp.down_proj.weight"].T


def reference_proposals(head_dir: str, target, tokens: list[int], k: int) -> list[int]:
    """k greedy guesses after ``tokens`` (a transformers target: its final-normed hidden states)."""
    w = load_file(os.path.join(head_dir, "model.safetensors"))
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    with torch.no_grad():
        feats = target.model(torch.tensor([tokens])).last_hidden_state[0, :-1]  # positions 0..n-2
        ids, guesses = list(tokens[1:]), []
        for _ in range(k):
            out = reference_head(w, embed, lm_head, ids, feats)
            guesses.append(int((out[-1] @ lm_head.T).argmax()))
            ids.append(guesses[-1])
            feats = torch.cat([feats, out[-1:]])
    return guesses


# ---- fixtures and helpers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def heads(tiny_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("eagle-heads")
    return {(norm, bias): write_head(str(base / f"n{int(norm)}b{int(bias)}"), tiny_models["llama"],
                                     input_norm=norm, fc_bias=bias)
            for norm, bias in ((False, False), (True, True))}


@pytest.fixture(scope="module")
def hf_target(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_models):
    return _tokens(LLM(tiny_models["llama"], dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=256))


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _stats(llm):
    return llm.llm_engine.engine_core.scheduler.make_stats()


def _record_proposals(llm) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, the head's guesses) of every proposal the head makes from now on."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    seen, after_step = [], runner.draft.after_step

    def recording(output):
        output = after_step(output)
        for req_id, guesses in output.spec_token_ids.items():
            seen.append((list(runner.requests[req_id].token_ids), list(guesses)))
        return output

    runner.draft.after_step = recording
    return seen


def _eagle(head: str, k: int) -> dict:
    return {"method": "eagle", "model": head, "num_speculative_tokens": k}


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_bias", [(False, False), (True, True)], ids=["published", "with-norm-and-bias"])
def test_head_proposals_equal_an_independent_forward_of_the_layout(tiny_models, heads, hf_target, norm_bias):
    head = heads[norm_bias]
    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=256,
              speculative_config=_eagle(head, 3))
    model = llm.llm_engine.engine_core.executor.worker.model_runner.draft.model
    assert (model.fc.bias is not None, not isinstance(model.layers[0].input_layernorm, torch.nn.Identity)) == norm_bias
    runner_target = llm.llm_engine.engine_core.executor.worker.model_runner.model
    assert model.compute_logits.__self__._shared[0] is runner_target.model.embed_tokens  # shared, not copied
    seen = _record_proposals(llm)
    _tokens(llm, PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(seen) >= 6
    for tokens, guesses in seen:
        assert guesses == reference_proposals(head, hf_target, tokens, len(guesses)), tokens
    assert {len(g) for _, g in seen} == {3}


def test_greedy_is_the_plain_engines_chunked_preempted_and_with_prefix_hits(tiny_models, heads, hf_target, reference):
    head = heads[(False, False)]
    llm = LLM(tiny_models["llama"], dtype="float32", max_model_len=160, max_num_batched_tokens=16, num_gpu_blocks_override=12,
              speculative_config=_eagle(head, 2))
    seen = _record_proposals(llm)
    assert _tokens(llm, PROMPTS + PROMPTS[:2]) == reference + reference[:2]  # the repeats hit the prefix cache
    stats = _stats(llm)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 <= stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens and stats.spec_num_drafts > 20
    # The head's cache stayed right through chunks, preemptions and hits: every guess is the reference's.
    for tokens, guesses in seen:
        assert guesses == reference_proposals(head, hf_target, tokens, len(guesses)), tokens


SMALL_VOCAB = 512
SMALL_PROMPTS = [[3 + t % (SMALL_VOCAB - 3) for t in p] for p in PROMPTS]


def test_an_aborted_request_leaves_the_others_and_the_next_ones_exact(tiny_models, heads, reference):
    llm = LLM(tiny_models["llama"], dtype="float32", max_model_len=160, max_num_batched_tokens=16, num_gpu_blocks_override=12,
              speculative_config=_eagle(heads[(True, True)], 3))
    engine, done = llm.llm_engine, {}
    for i in (0, 1, 4):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=PROMPTS[i]), GREEDY)
    for n in range(200):
        if n == 8:
            engine.abort_request("4")  # while the others decode (with drafts) or prefill
            engine.add_request("5", TokensPrompt(prompt_token_ids=PROMPTS[5]), GREEDY)
        done.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert done == {"0": reference[0], "1": reference[1], "5": reference[5]}


@pytest.fixture(scope="module")
def predictable(tmp_path_factory, smollm2_tokenizer_dir):
    """A target whose next token depends on the last one only (attention and MLP outputs zeroed,
    unit norms: the final hidden state is the normed embedding) and the head that is exact for it:
    fc passes the token's embedding through, its layer adds nothing, the shared LM head scores it
    (the same argmax as the target's on the normed embedding). A small vocabulary keeps sampling
    cheap."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = str(tmp_path_factory.mktemp("bigram-target"))
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(_tiny_config("llama", SMALL_VOCAB), dtype=torch.float32).save_pretrained(target)
    AutoTokenizer.from_pretrained(smollm2_tokenizer_dir).save_pretrained(target)
    w = load_file(os.path.join(target, "model.safetensors"))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
        elif name.endswith("norm.weight"):
            w[name] = torch.ones_like(w[name])
    save_file(w, os.path.join(target, "model.safetensors"))
    exact = {"fc.weight": torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], 1),
             "layers.0.self_attn.o_proj.weight": torch.zeros(HIDDEN, HIDDEN),
             "layers.0.mlp.down_proj.weight": torch.zeros(HIDDEN, INTER)}
    head = write_head(str(tmp_path_factory.mktemp("exact-head")), target, input_norm=False, fc_bias=False,
                      weights=exact)
    return target, head


def test_an_exact_head_has_every_guess_accepted_and_the_target_runs_fewer_steps(predictable):
    target, head = predictable
    plain = _tokens(LLM(target, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=256), SMALL_PROMPTS[:3])
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=256, speculative_config=_eagle(head, 3))
    core = llm.llm_engine.engine_core
    steps, execute = 0, core.executor.execute_model

    def counting(*args, **kwargs):
        nonlocal steps
        steps += 1
        return execute(*args, **kwargs)

    core.executor.execute_model = counting
    assert _tokens(llm, SMALL_PROMPTS[:1]) == plain[:1]
    stats = _stats(llm)
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    assert steps <= len(plain[0]) // 3 + 2
    del core.executor.execute_model
    assert _tokens(llm, SMALL_PROMPTS[:3]) == plain


def test_sampled_tokens_keep_the_target_distribution(predictable):
    """The exact head proposes the target's most likely token (a point mass the target often
    rejects at temperature 1): the first two sampled tokens' joint distribution must match the
    plain engine's (total variation; always accepting would be off by about the rejection rate)."""
    target, head = predictable
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    runs, prompt = 3000, [SMALL_PROMPTS[2]]

    def pairs(llm):
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompt[0])] * runs, params, use_tqdm=False)
        return collections.Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs)

    plain = pairs(LLM(target, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=64))
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=64, speculative_config=_eagle(head, 2))
    spec = pairs(llm)
    stats = _stats(llm)
    assert stats.spec_num_drafts >= runs and runs // 4 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens * 0.9
    keys = set(plain) | set(spec)
    assert len(keys) <= 9
    # Two samples of 3000 from one distribution on 9 pairs differ by ~0.03 in total variation;
    # accepting every guess would move about 0.4 of the mass here (59% of the guesses are accepted).
    assert sum(abs(plain[k] - spec[k]) for k in keys) / (2 * runs) < 0.06


def test_a_dummy_loaded_head_runs(tiny_models, heads):
    llm = LLM(tiny_models["llama"], load_format="dummy", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=128,
              speculative_config=_eagle(heads[(True, True)], 2))
    assert all(len(t) == 20 for t in _tokens(llm, PROMPTS[:2]))
    assert _stats(llm).spec_num_draft_tokens > 0


def test_a_head_named_eagle_needs_no_method_as_in_vllm():
    from pagedllm.config import SpeculativeConfig

    assert SpeculativeConfig.from_dict({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}).method == "eagle"
    assert SpeculativeConfig.from_dict({"model": "/eagle/llama-3.2-1b"}).method == "draft_model"
    assert SpeculativeConfig.from_dict({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}).method == "eagle3"


def test_bad_eagle_configs_are_refused_naming_the_key(tiny_models, tmp_path):
    narrow = write_head(str(tmp_path / "narrow"), tiny_models["llama"], input_norm=False, fc_bias=False, hidden=32)
    for model, spec, match in (
            (tiny_models["llama"], {"method": "eagle"}, "'eagle' needs model"),
            (tiny_models["llama"], _eagle(narrow, 2), "hidden_size is 32, the target's 64"),
            (tiny_models["qwen2"], _eagle(narrow, 2), "needs a target of architecture"),
            (tiny_models["llama"], {**_eagle(narrow, 2), "num_speculative_tokens": 0}, "num_speculative_tokens"),
            (tiny_models["llama"], {**_eagle(narrow, 2), "draft_tensor_parallel_size": 2},
             "draft_tensor_parallel_size")):
        with pytest.raises(ValueError, match=match):
            LLM(model, max_model_len=64, speculative_config=spec)
