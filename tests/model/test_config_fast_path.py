"""Start-up: a config.json that spells out what the models read is loaded as a plain
PretrainedConfig (no model-type class import, which costs seconds); the model built from it
is the one transformers' own config class gives, and incomplete configs still go through
that class."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from pagedllm.benchmarks.common import SHAPES
from pagedllm.model.loader import _TYPE_KEYS
from pagedllm.engine.arg_utils import _resolve_dtype
from pagedllm.model.layers import RotaryEmbedding
from pagedllm.model.llama import _sliding_window
from pagedllm.model.loader import _complete_config, _load_config, get_model_class


def what_the_model_reads(config) -> dict:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    model_cls = get_model_class(config.architectures)
    rotary = RotaryEmbedding(head_dim, 64, config)  # the table for the first 64 positions
    return dict(
        model_cls=model_cls, sizes=(config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                                    config.vocab_size, heads, getattr(config, "num_key_value_heads", None) or heads,
                                    head_dim),
        eps=config.rms_norm_eps, tie=bool(getattr(config, "tie_word_embeddings", False)),
        biases=model_cls.attention_biases(config), mlp_bias=getattr(config, "mlp_bias", False),
        act=getattr(config, "hidden_act", "silu"), max_pos=config.max_position_embeddings,
        windows=[_sliding_window(config, i) for i in range(config.num_hidden_layers)],
        rope=rotary.cos_sin_cache, dtype=_resolve_dtype("auto", config, "cuda"),  # the GPU dtype it implies
    )


MISTRAL = dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-5,
               max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu", rope_theta=1e6,
               sliding_window=32)
QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64, intermediate_size=128,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-6,
             max_position_embeddings=256, tie_word_embeddings=True, hidden_act="silu", rope_theta=1e6)
CASES = {
    # The dense benchmark shapes (the MoE families build their config class: no fast path).
    **{name: shape for name, shape in SHAPES.items() if shape["model_type"] in _TYPE_KEYS},
    "mistral": MISTRAL,
    "qwen2-no-window": {**QWEN2, "sliding_window": 16, "use_sliding_window": False},
    "qwen2-null-window": {**QWEN2, "sliding_window": None},
    "qwen2-window-by-layer": {**QWEN2, "sliding_window": 16, "use_sliding_window": True,
                              "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2},
    "llama-rope-scaling-legacy": {**SHAPES["tiny-llama"], "rope_scaling": {"type": "linear", "factor": 2.0}},
}


def _class_config(folder) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.from_pretrained(str(folder))


@pytest.mark.parametrize("name", sorted(CASES))
def test_complete_configs_take_the_fast_path_and_build_the_same_model(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(CASES[name]))
    fast = _load_config(tmp_path, trust_remote_code=False)
    assert type(fast) is transformers.PretrainedConfig  # no model-type class was needed
    got, want = what_the_model_reads(fast), what_the_model_reads(_class_config(tmp_path))
    assert torch.equal(got.pop("rope"), want.pop("rope"))
    assert got == want


def test_tiny_test_models_take_the_fast_path(tiny_models):
    for folder in tiny_models.values():
        raw = json.loads(open(f"{folder}/config.json").read())
        fast = _complete_config(raw)
        assert fast is not None
        got, want = what_the_model_reads(fast), what_the_model_reads(_class_config(folder))
        assert torch.equal(got.pop("rope"), want.pop("rope"))
        assert got == want


@pytest.mark.parametrize("drop_or_set", [
    {"drop": "num_key_value_heads"},  # class defaults differ (heads, 8, 32): never guessed
    {"drop": "head_dim", "model_type": "qwen3"},  # Qwen3 defaults to 128, not hidden / heads
    {"drop": "sliding_window", "model_type": "mistral"},  # Mistral defaults to 4096
    {"set": {"sliding_window": 16}, "model_type": "qwen2"},  # sliding or not: the class decides
    {"drop": "rope_theta"},
    {"set": {"auto_map": {"AutoConfig": "x.Y"}}},
])
def test_incomplete_configs_go_through_the_model_type_class(tmp_path, drop_or_set):
    model_type = drop_or_set.get("model_type", "llama")
    raw = dict({"llama": SHAPES["tiny-llama"], "mistral": MISTRAL, "qwen2": QWEN2,
                "qwen3": SHAPES["qwen3-0.6b"]}[model_type])
    raw.pop(drop_or_set.get("drop", ""), None)
    raw.update(drop_or_set.get("set", {}))
    assert _complete_config(raw) is None
    if "auto_map" not in raw:
        (tmp_path / "config.json").write_text(json.dumps(raw))
        assert type(_load_config(tmp_path, trust_remote_code=False)) is not transformers.PretrainedConfig
