"""Issue 16's checkpoints beyond the common cases of test_models.py: Gemma 3 vision-language
checkpoints served as their text model (both weight-name layouts), Phi-3 LongRoPE's long factors
past the pretraining length, and the registry's error naming every supported architecture."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedllm.model import SUPPORTED_ARCHITECTURES, get_model_class, load_model, resolve_model
from tests.model.test_models import TINY, _attach_paged_cache, _hf_logits, _metadata

PROMPT = [(7 * i + 3) % 500 for i in range(40)]


def _our_logits(model, prompt: list[int]) -> torch.Tensor:
    blocks = -(-len(prompt) // 16)
    _attach_paged_cache(model, num_blocks=blocks)
    positions, meta = _metadata([len(prompt)], [len(prompt)], [list(range(blocks))])
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(prompt), positions, meta))


@pytest.fixture(scope="module")
def gemma3_vlm(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration (a one-layer SigLIP tower) as transformers saves it."""
    folder = tmp_path_factory.mktemp("gemma3-vlm")
    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(**{**TINY, "initializer_range": 0.1}, head_dim=16, sliding_window=8,
                                         sliding_window_pattern=2)  # real Gemma 3 configs have no final cap
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=500, boi_token_index=501,
                                       eoi_token_index=502)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "language_model" in name and "norm" in name:
                p.uniform_(-0.5, 0.5)
    hf_model.save_pretrained(folder)
    return folder, hf_model


def test_gemma3_vision_language_checkpoint_serves_its_text_model(gemma3_vlm, tmp_path):
    folder, hf_model = gemma3_vlm
    resolved = resolve_model(str(folder))
    assert resolved.hf_config.model_type == "gemma3_text"  # the text config, for every room that reads it
    assert resolved.hf_config.architectures == ["Gemma3ForConditionalGeneration"]
    model = load_model(resolved, "auto", torch.float32, torch.device("cpu"))
    expected = _hf_logits(hf_model, PROMPT)
    torch.testing.assert_close(_our_logits(model, PROMPT), expected, atol=1e-4, rtol=1e-4)
    # The other layout (model.language_model.*, model.vision_tower.*) loads the same text model.
    tensors = load_file(folder / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in tensors)
    renamed = {("model." + k.replace("language_model.model.", "language_model.", 1)
                if not k.startswith("lm_head") else k): v for k, v in tensors.items()}
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    model = load_model(resolve_model(str(tmp_path)), "auto", torch.float32, torch.device("cpu"))
    torch.testing.assert_close(_our_logits(model, PROMPT), expected, atol=1e-4, rtol=1e-4)


def test_phi3_longrope_long_factors_past_the_pretraining_length(tmp_path):
    """Serving past original_max_position_embeddings (max_model_len 256 > 32) takes the long
    factors and the attention factor sqrt(1 + ln 8 / ln 32); transformers takes them for a
    forward longer than 32 tokens, as this 40-token prompt is."""
    torch.manual_seed(0)
    config = transformers.Phi3Config(**{**TINY, "max_position_embeddings": 256}, pad_token_id=0, eos_token_id=2,
                                     original_max_position_embeddings=32, rope_scaling={
                                         "type": "longrope", "short_factor": [1.0] * 8,
                                         "long_factor": [1.0 + i for i in range(8)]})
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf_model.save_pretrained(tmp_path)
    resolved = resolve_model(str(tmp_path))
    expected = _hf_logits(hf_model, PROMPT)
    model = load_model(resolved, "auto", torch.float32, torch.device("cpu"), max_model_len=256)
    torch.testing.assert_close(_our_logits(model, PROMPT), expected, atol=1e-4, rtol=1e-4)
    short = load_model(resolved, "auto", torch.float32, torch.device("cpu"), max_model_len=32)
    assert (_our_logits(short, PROMPT) - expected).abs().max() > 1e-2  # the short factors differ


def test_longrope_factor_count_is_checked(tmp_path):
    config = transformers.Phi3Config(**TINY, pad_token_id=0, eos_token_id=2, original_max_position_embeddings=32,
                                     rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                                   "long_factor": [1.0] * 8})
    config.rope_parameters["long_factor"] = [1.0] * 3
    config.architectures = ["Phi3ForCausalLM"]
    with pytest.raises(ValueError, match="long_factor has 3 entries, expected rotary_dim / 2 = 8"):
        get_model_class(config.architectures)(config, max_model_len=256)


def test_unsupported_architecture_lists_every_supported_one():
    with pytest.raises(ValueError, match="not supported") as e:
        get_model_class(["GPTNeoXForCausalLM"])
    for name in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Phi3ForCausalLM",
                 "OlmoForCausalLM", "Olmo2ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"):
        assert name in SUPPORTED_ARCHITECTURES and name in str(e.value)


def test_gemma_bidirectional_config_is_refused():
    config = transformers.Gemma3TextConfig(**TINY, head_dim=16, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        get_model_class(["Gemma3ForCausalLM"])(config)
