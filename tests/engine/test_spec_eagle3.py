"""Speculative decoding with an EAGLE-3 head, written here in the published layout (safetensors +
config.json: ``fc`` over three residual streams of the target, ``midlayer.*`` with ``hidden_norm`` and
2 * hidden q/k/v inputs, ``norm``, a ``lm_head`` over a draft vocabulary smaller than the target's,
``d2t``/``t2d``). Its proposals equal a plain-torch forward of that layout (written below from the
layout, not from pagedllm's classes) over the residual streams transformers returns as
``output_hidden_states``, for every guess of a chunked, preempted, prefix-hit run whose greedy
outputs are the plain engine's; sampled runs keep the target's distribution; bad configs are
refused naming the key."""
from __future__ import annotations

import collections
import functools
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams, TokensPrompt
from tests.conftest import TEST_KV_BYTES, _tiny_config
from tests.engine.test_correctness import mixed_prompts
from tests.engine.test_spec_eagle import _record_proposals, _rms, reference_layer

HIDDEN, HEADS, KV_HEADS, INTER, EPS, THETA = 64, 4, 2, 128, 1e-6, 10000.0
LAYERS, VOCAB = 3, 512  # 3 target layers: the default aux layers (2, L // 2, L - 3) are 2, 1, 0
# The draft vocabulary: 4 target ids, irregular (d2t offsets differ); the target is built to prefer
# them, so guesses are often in its top 3 and both accepted and rejected under sampling.
DRAFT_IDS = [17, 130, 301, 511]
PROMPTS = [[3 + t % (VOCAB - 3) for t in p] for p in mixed_prompts(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, detokenize=False)
HEADS_UNDER_TEST = {  # name -> (own embed_tokens, eagle_aux_hidden_state_layer_ids, norm_before_residual)
    "published": (False, None, False),
    "own-embed-layers-1-0-2-norm-first": (True, [1, 0, 2], True),
}


def write_head(out_dir: str, target: str, *, own_embed: bool = False, aux_ids: list[int] | None = None,
               norm_before_residual: bool = False, seed: int = 3, config: dict | None = None,
               weights: dict | None = None) -> str:
    """An EAGLE-3 head as the published checkpoints store it (random weights unless given)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    head_dim, n = HIDDEN // HEADS, len(DRAFT_IDS)
    w = {"fc.weight": rnd(HIDDEN, 3 * HIDDEN, std=0.1),
         "midlayer.input_layernorm.weight": 1 + rnd(HIDDEN, std=0.1),
         "midlayer.hidden_norm.weight": 1 + rnd(HIDDEN, std=0.1),
         "midlayer.self_attn.q_proj.weight": rnd(HEADS * head_dim, 2 * HIDDEN),
         "midlayer.self_attn.k_proj.weight": rnd(KV_HEADS * head_dim, 2 * HIDDEN),
         "midlayer.self_attn.v_proj.weight": rnd(KV_HEADS * head_dim, 2 * HIDDEN),
         "midlayer.self_attn.o_proj.weight": rnd(HIDDEN, HEADS * head_dim),
         "midlayer.mlp.gate_proj.weight": rnd(INTER, HIDDEN),
         "midlayer.mlp.up_proj.weight": rnd(INTER, HIDDEN),
         "midlayer.mlp.down_proj.weight": rnd(HIDDEN, INTER),
         "midlayer.post_attention_layernorm.weight": 1 + rnd(HIDDEN, std=0.1),
         "norm.weight": 1 + rnd(HIDDEN, std=0.1),
         "lm_head.weight": rnd(n, HIDDEN, std=0.5),
         "d2t": torch.tensor(DRAFT_IDS) - torch.arange(n),
         "t2d": torch.isin(torch.arange(VOCAB), torch.tensor(DRAFT_IDS))}
    if own_embed:
        w["embed_tokens.weight"] = rnd(VOCAB, HIDDEN, std=0.5)
    w.update(weights or {})
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(out_dir, "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "draft_vocab_size": n,
           "target_hidden_size": HIDDEN, "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 512,
           "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32"}
    if aux_ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = aux_ids
    if norm_before_residual:
        cfg["norm_before_residual"] = True
    cfg.update(config or {})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir


# ---- the independent reference: the published layout in plain torch ------------------------------
# (_rms, _rope and the decoder layer are test_spec_eagle's: the same Llama layer and constants.)


def reference_head(w: dict, embed: torch.Tensor, ids: list[int], feats: torch.Tensor, norm_first: bool):
    """Rows p = 0..T-1 with inputs (embed(ids[p]), feats[p]) at positions p, causal: [T, hidden]
    outputs before the final norm."""
    e = _rms(embed[torch.tensor(ids)], w["midlayer.input_layernorm.weight"])
    hn = _rms(feats, w["midlayer.hidden_norm.weight"])
    h = torch.cat([e, hn], -1)
    return reference_layer(w, "midlayer.", h, hn if norm_first else feats)


@functools.lru_cache(maxsize=None)
def _head_files(head_dir: str) -> tuple[dict, dict]:
    with open(os.path.join(head_dir, "config.json")) as f:
        return load_file(os.path.join(head_dir, "model.safetensors")), json.load(f)


class TargetStreams:
    """The residual streams entering every layer of a transformers target (its
    ``hidden_states[i]``, i < L), one forward per sequence: a causal model's streams over a prefix
    are those of any longer sequence, cut."""

    def __init__(self, target):
        self.target, self.known = target, []

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        for seq, streams in self.known:
            if seq[:len(tokens)] == tokens:
                return streams[:, :len(tokens)]
        with torch.no_grad():
            outs = self.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            streams = torch.stack(outs[:-1])[:, 0]
        self.known.append((list(tokens), streams))
        return streams


def reference_proposals(head_dir: str, streams: TargetStreams, tokens: list[int], k: int) -> list[int]:
    """k greedy guesses after ``tokens``."""
    w, cfg = _head_files(head_dir)
    aux_ids = cfg.get("eagle_aux_hidden_state_layer_ids") or [2, LAYERS // 2, LAYERS - 3]
    embed = w.get("embed_tokens.weight", streams.target.model.embed_tokens.weight)
    with torch.no_grad():
        aux = streams(tokens)
        feats = torch.cat([aux[i, :-1] for i in aux_ids], -1) @ w["fc.weight"].T  # positions 0..n-2
        ids, guesses = list(tokens[1:]), []
        for _ in range(k):
            pre = reference_head(w, embed, ids, feats, cfg.get("norm_before_residual", False))[-1:]
            d = int((_rms(pre, w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
            guesses.append(d + int(w["d2t"][d]))
            ids.append(guesses[-1])
            feats = torch.cat([feats, pre])  # later guesses read the head's own output, not re-fused
    return guesses


# ---- fixtures and helpers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """One 3-layer target of a 512-token vocabulary whose LM head favours DRAFT_IDS (the other
    rows scaled down), shared by every test."""
    from transformers import AutoModelForCausalLM

    out = str(tmp_path_factory.mktemp("eagle3-target"))
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(_tiny_config("llama", VOCAB, num_hidden_layers=LAYERS),
                                             dtype=torch.float32)
    with torch.no_grad():
        keep = torch.isin(torch.arange(VOCAB), torch.tensor(DRAFT_IDS))
        model.lm_head.weight[~keep] *= 0.05
    model.save_pretrained(out)  # no tokenizer: the engines run token ids (skip_tokenizer_init)
    return out


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("eagle3-heads")
    # The second head says it was trained on 32 positions (as the published heads say 2048): it
    # still runs, and guesses as the layout does, past them.
    return {name: write_head(str(base / name), target, own_embed=own, aux_ids=ids, norm_before_residual=first,
                             config={"max_position_embeddings": 512 if name == "published" else 32})
            for name, (own, ids, first) in HEADS_UNDER_TEST.items()}


@pytest.fixture(scope="module")
def hf_streams(target, reference):
    from transformers import AutoModelForCausalLM

    streams = TargetStreams(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval())
    for prompt, out in zip(PROMPTS, reference):  # every proposal's tokens are a prefix of one of these
        streams(prompt + out)
    return streams


@pytest.fixture(scope="module")
def reference(target):
    return _tokens(_llm(target, max_model_len=256))


def _llm(model: str, **kwargs) -> LLM:
    """An engine over token ids (the models here have no tokenizer)."""
    return LLM(model, **{"skip_tokenizer_init": True, "dtype": "float32", "kv_cache_memory_bytes": TEST_KV_BYTES,
                         **kwargs})


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _stats(llm):
    return llm.llm_engine.engine_core.scheduler.make_stats()


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _eagle3(head: str, k: int) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k}


# ---- tests ------------------------------------------------------------------------------------
def test_greedy_is_the_plain_engines_and_every_guess_the_layouts_chunked_preempted_with_prefix_hits(
        target, heads, hf_streams, reference):
    head = heads["published"]
    llm = _llm(target, max_model_len=160, max_num_batched_tokens=16, num_gpu_blocks_override=12,
               speculative_config=_eagle3(head, 3))
    model = _runner(llm).draft.model
    assert model.embed_tokens is None  # absent from the checkpoint: the target's, shared
    assert model.lm_head.weight.shape == (len(DRAFT_IDS), HIDDEN)
    dev = model.d2t.device
    assert model.to_target(torch.arange(len(DRAFT_IDS), device=dev)).tolist() == DRAFT_IDS
    seen = _record_proposals(llm)
    assert _tokens(llm, PROMPTS + PROMPTS[:2]) == reference + reference[:2]  # the repeats hit the prefix cache
    stats = _stats(llm)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens and stats.spec_num_drafts > 20
    # The head's cache and the target's aux buffer stayed right through chunks, preemptions and hits.
    assert len(seen) > 20 and {len(g) for _, g in seen} == {3}
    for tokens, guesses in seen:
        assert guesses == reference_proposals(head, hf_streams, tokens, len(guesses)), tokens


def test_a_head_with_its_own_embedding_layer_ids_and_norm_before_residual_guesses_as_the_layout(
        target, heads, hf_streams, reference):
    head = heads["own-embed-layers-1-0-2-norm-first"]
    llm = _llm(target, max_model_len=160, speculative_config=_eagle3(head, 3))
    model = _runner(llm).draft.model
    assert model.embed_tokens is not None and model.norm_before_residual
    seen = _record_proposals(llm)
    assert _tokens(llm, PROMPTS[:3]) == reference[:3]
    assert len(seen) > 6 and max(len(tokens) for tokens, _ in seen) > 64  # well past its 32 positions
    for tokens, guesses in seen:
        assert guesses == reference_proposals(head, hf_streams, tokens, len(guesses)), tokens


def test_draft_probabilities_are_over_the_target_vocabulary(target, heads):
    llm = _llm(target, max_model_len=64,
              speculative_config=_eagle3(heads["published"], 2))
    model = _runner(llm).draft.model
    dev = model.d2t.device
    hidden = torch.randn(5, HIDDEN, device=dev, dtype=model.norm.weight.dtype)
    probs = torch.softmax(model.compute_logits(hidden).float(), dim=-1)
    assert probs.shape == (5, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool, device=dev)
    outside[DRAFT_IDS] = False
    assert probs[:, outside].max() == 0  # target ids outside the draft vocabulary: draft probability 0
    torch.testing.assert_close(probs[:, DRAFT_IDS], torch.softmax(model.compute_draft_logits(hidden).float(), dim=-1))
    assert model.greedy_tokens(hidden).tolist() == probs.argmax(dim=-1).tolist()


def test_sampled_tokens_keep_the_target_distribution(target, heads):
    """The random head's guess for the second token (a target id of the draft vocabulary, which
    the target favours) is accepted about half the time at temperature 1, top-k 3: the first two
    sampled tokens' joint distribution must match the plain engine's."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, detokenize=False)
    runs, prompt = 800, PROMPTS[2]

    def pairs(llm):
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * runs, params, use_tqdm=False)
        return collections.Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs)

    plain_llm = _llm(target, max_model_len=64)
    assert _runner(plain_llm).model.model.aux_hidden_states is None  # no EAGLE-3 head: nothing captured
    plain = pairs(plain_llm)
    llm = _llm(target, max_model_len=64, speculative_config=_eagle3(heads["published"], 2))
    aux = _runner(llm).model.model.aux_hidden_states
    assert aux.shape[1] == 3 * HIDDEN and aux.shape[0] >= _runner(llm).max_num_tokens
    buffer_at = aux.data_ptr()
    spec = pairs(llm)
    assert _runner(llm).model.model.aux_hidden_states.data_ptr() == buffer_at  # static: CUDA graphs refill it
    stats = _stats(llm)
    assert stats.spec_num_drafts == stats.spec_num_draft_tokens == runs  # max_tokens=3 leaves room for one
    assert runs // 4 < stats.spec_num_accepted_tokens < runs * 3 // 4
    keys = set(plain) | set(spec)
    assert len(keys) <= 9
    # Two samples of 800 from one distribution on 9 pairs differ by ~0.05 in total variation (sd
    # ~0.015); accepting every guess moves 0.53 of the mass here (PAGEDLLM_SPEC_FORCE_ACCEPT=1).
    assert sum(abs(plain[k] - spec[k]) for k in keys) / (2 * runs) < 0.12


def test_a_dummy_loaded_head_runs(target, heads):
    llm = _llm(target, load_format="dummy", max_model_len=128,
              speculative_config=_eagle3(heads["published"], 2))
    assert all(len(t) == 20 for t in _tokens(llm, PROMPTS[:2]))
    assert _stats(llm).spec_num_draft_tokens > 0


def test_a_head_named_eagle3_needs_no_method_as_in_vllm():
    from pagedllm.config import SpeculativeConfig

    assert SpeculativeConfig.from_dict({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}).method == "eagle3"
    assert SpeculativeConfig.from_dict({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}).method == "eagle"


def test_bad_eagle3_configs_are_refused_naming_the_key(target, tmp_path):
    from transformers import AutoModelForCausalLM

    qwen = str(tmp_path / "qwen2")
    AutoModelForCausalLM.from_config(_tiny_config("qwen2", VOCAB)).save_pretrained(qwen)

    def head(name, **kwargs):
        return write_head(str(tmp_path / name), target, **kwargs)

    good = head("good")
    for model, spec, match in (
            (target, {"method": "eagle3"}, "'eagle3' needs model"),
            (target, _eagle3(head("wide", config={"target_hidden_size": 32}), 2), "target_hidden_size"),
            (qwen, _eagle3(good, 2), "'eagle3' needs a target of architecture"),
            (target, {**_eagle3(good, 2), "num_speculative_tokens": 0}, "num_speculative_tokens"),
            (target, _eagle3(head("vocab", config={"vocab_size": 1024}), 2), "vocab_size is 1024"),
            (target, _eagle3(head("draft", config={"draft_vocab_size": 1024}), 2), "draft_vocab_size"),
            (target, _eagle3(head("aux", aux_ids=[0, 1, 3]), 2), "eagle_aux_hidden_state_layer_ids"),
            (target, _eagle3(head("aux-twice", aux_ids=[0, 1, 1]), 2), "eagle_aux_hidden_state_layer_ids"),
            (target, _eagle3(head("d2t", weights={"d2t": torch.zeros(3, dtype=torch.int64)}), 2),
             "'d2t' has shape \\(3,\\).*draft_vocab_size"),
            (target, _eagle3(head("d2t-range", weights={"d2t": torch.full((4,), 600)}), 2),
             "'d2t' maps draft ids .* outside the target vocabulary"),
            (target, _eagle3(head("no-fc", config={"eagle_config": {"use_aux_hidden_state": False}}), 2),
             "use_aux_hidden_state")):
        with pytest.raises(ValueError, match=match):
            _llm(model, max_model_len=64,
                speculative_config=spec)
    if not torch.cuda.is_available() or torch.cuda.device_count() >= 2:  # else the GPU count is refused first
        with pytest.raises(ValueError, match="tensor_parallel_size=1 only"):
            _llm(target, max_model_len=64, tensor_parallel_size=2, speculative_config=_eagle3(good, 2))
