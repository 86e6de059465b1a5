"""LoRA adapters against `peft` on a tiny random Llama: greedy tokens identical in fp32 for each
adapter (ranks 4, 8 and 64, rsLoRA, every projection or a few); one batch mixing three adapters
and the base runs one forward per step; evicting and reloading adapters (one device slot)
changes nothing; adapters under preemption, chunked prefill and n=2 keep peft's tokens; the
prefix cache never shares blocks across adapters; bad adapters are refused before they reach the
engine."""
from __future__ import annotations

import functools

import pytest
import torch

from tests.conftest import TEST_KV_BYTES
from pagedllm import LLM, LoRARequest, SamplingParams, TokensPrompt
from tests.engine.test_correctness import mixed_prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: (rank, alpha, target modules, use_rslora)
    "all8": (8, 16, ALL, False),
    "qv64": (64, 32, ["q_proj", "v_proj"], True),
    "mlp4": (4, 8, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
}
PROMPTS = mixed_prompts(6)
MAX_TOKENS = 10


def _make_adapter(base_dir: str, out_dir: str, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                     init_lora_weights=False)  # random A and B: the adapter changes the outputs
    model = get_peft_model(base, cfg)
    with torch.no_grad():  # peft's non-init B is small: scale it so every adapter moves the greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict[str, LoRARequest]:
    base = tiny_models["llama"]
    return {name: LoRARequest(name, i + 1, _make_adapter(base, str(tmp_path_factory.mktemp(f"lora-{name}")), *spec,
                                                          seed=i))
            for i, (name, spec) in enumerate(ADAPTERS.items())}


@functools.lru_cache(maxsize=None)
def _peft_greedy(base_dir: str, adapter_dir: str | None) -> tuple[tuple[int, ...], ...]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
            out.append(tuple(gen[0, len(ids):].tolist()))
    return tuple(out)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES,
               dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=64,
               max_model_len=256)


def _generate(llm, loras, prompts=PROMPTS):
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False, lora_request=loras)
    return [tuple(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_gives_peft_greedy_tokens(llm, tiny_models, adapters, name):
    want = list(_peft_greedy(tiny_models["llama"], adapters[name].lora_path))
    assert want != list(_peft_greedy(tiny_models["llama"], None))  # the adapter does change the outputs
    assert _generate(llm, adapters[name]) == want


def test_a_batch_mixing_adapters_and_the_base_runs_one_forward_per_step(llm, tiny_models, adapters):
    names = list(ADAPTERS) + [None]
    loras = [adapters[names[i % 4]] if names[i % 4] else None for i in range(len(PROMPTS))]
    want = []
    for i, lora in enumerate(loras):
        want.append(_peft_greedy(tiny_models["llama"], lora.lora_path if lora else None)[i])
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    forwards, steps = 0, 0
    model_forward = runner.model.forward
    core_step = llm.llm_engine.engine_core.step

    def counting_forward(*args, **kwargs):
        nonlocal forwards
        forwards += 1
        return model_forward(*args, **kwargs)

    def counting_step(*args, **kwargs):
        nonlocal steps
        steps += 1
        return core_step(*args, **kwargs)

    runner.model.forward = counting_forward
    llm.llm_engine.engine_core.step = counting_step
    pieces = runner.graphs.piecewise
    replays = pieces.lora_replays if pieces is not None else 0
    try:
        got = _generate(llm, loras)
    finally:
        del runner.model.forward, llm.llm_engine.engine_core.step
    assert got == want
    if torch.cuda.is_available():  # decode steps with adapters replay the LoRA graphs, prefill steps the pieces
        assert runner.graphs.lora_graphs and set(runner.graphs.lora_graphs) == set(runner.graphs.graphs)
        assert set(pieces.lora_graphs) == set(pieces.graphs) and pieces.lora_replays > replays
    else:
        assert forwards > 0
    assert forwards <= steps  # at most one forward per step (CUDA graphs replay base-only ones), any mix


def test_one_device_slot_evicts_and_reloads_with_the_same_tokens(tiny_models, adapters):
    small = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES,
                dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2,
                max_lora_rank=64, max_model_len=256)
    names = list(ADAPTERS)
    loras = [adapters[names[i % 3]] for i in range(len(PROMPTS))]
    want = [_peft_greedy(tiny_models["llama"], lora.lora_path)[i] for i, lora in enumerate(loras)]
    assert _generate(small, loras) == want
    manager = small.llm_engine.engine_core.executor.worker.model_runner.lora
    assert manager.num_loads > 3 and len(manager.host) <= 2
    core = small.llm_engine.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def test_adapters_compose_with_preemption_chunking_and_n(tiny_models, adapters):
    """Three adapters and the base mixed, with a KV cache too small for the batch (preemption),
    32-token prefill chunks (the smallest piece), two device slots for three adapters and n=2:
    every sequence is its adapter's peft greedy output, and afterwards no block is held. On a GPU
    the prompt chunks replay the LoRA pieces."""
    small = LLM(tiny_models["llama"], num_gpu_blocks_override=12, block_size=16, dtype="float32", enable_lora=True,
                max_loras=2, max_lora_rank=64, max_model_len=160, max_num_batched_tokens=32,
                enable_prefix_caching=False)
    names = list(ADAPTERS) + [None]
    loras = [adapters[names[i % 4]] if names[i % 4] else None for i in range(len(PROMPTS))]
    want = [_peft_greedy(tiny_models["llama"], lora.lora_path if lora else None)[i] for i, lora in enumerate(loras)]
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = small.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False, lora_request=loras)
    assert [[tuple(c.token_ids) for c in o.outputs] for o in outs] == [[w, w] for w in want]
    core = small.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    runner = core.executor.worker.model_runner
    assert len(runner.lora.slot_of) <= 2
    if torch.cuda.is_available():
        assert runner.graphs.piecewise.lora_graphs and runner.graphs.piecewise.lora_replays > 0


def test_the_prefix_cache_never_shares_blocks_across_adapters(llm, adapters):
    kv = llm.llm_engine.engine_core.kv_cache_manager
    prompt = [list(range(100, 150))]  # no earlier request saw it; long enough for full blocks
    _generate(llm, adapters["all8"], prompt)
    hits = kv.stats.hits
    _generate(llm, adapters["qv64"], prompt)
    assert kv.stats.hits == hits  # the same tokens under another adapter: no hit
    _generate(llm, adapters["all8"], prompt)
    assert kv.stats.hits > hits  # the same adapter again: hits


def test_bad_adapters_are_refused_before_the_engine_and_it_serves_on(llm, tiny_models, adapters, tmp_path):
    qwen_adapter = _make_adapter(tiny_models["qwen3"], str(tmp_path / "qwen"), 4, 8, ["q_proj"], False, seed=9)
    head_adapter = _make_adapter(tiny_models["llama"], str(tmp_path / "head"), 4, 8, ["q_proj", "lm_head"], False,
                                 seed=9)
    _generate(llm, adapters["all8"], PROMPTS[:1])  # id 1 names all8 from here on
    for lora, match in ((LoRARequest("x", 7, str(tmp_path / "missing")), "is not a folder"),
                        (LoRARequest("q", 8, qwen_adapter), "does not fit|base model needs"),
                        (LoRARequest("h", 9, head_adapter), "lm_head"),
                        (LoRARequest("dup", 1, qwen_adapter), "already names the adapter")):
        with pytest.raises(ValueError, match=match):
            _generate(llm, lora)
    big = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES,
              dtype="float32", enable_lora=True, max_lora_rank=16, max_model_len=64)
    with pytest.raises(ValueError, match="rank 64, more than max_lora_rank=16"):
        _generate(big, adapters["qv64"])
    plain = LLM(tiny_models["llama"], kv_cache_memory_bytes=TEST_KV_BYTES, dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora=True"):
        _generate(plain, adapters["all8"])
    with pytest.raises(ValueError, match="enable_lora is not supported with pipeline parallelism"):
        LLM(tiny_models["llama"], enable_lora=True, pipeline_parallel_size=2, max_model_len=64)
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("z", 0, "/tmp")
    assert _generate(llm, adapters["all8"]) == list(_peft_greedy(tiny_models["llama"], adapters["all8"].lora_path))
    core = llm.llm_engine.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks


def test_a_trainer_pushes_adapters_from_memory_and_manages_them(llm, tiny_models, adapters):
    """add_lora with tensors replaces an id's weights (the outputs follow); pin, list, remove."""
    import json
    import os

    from safetensors.torch import load_file

    def in_memory(name):
        path = adapters[name].lora_path
        with open(os.path.join(path, "adapter_config.json")) as f:
            cfg = json.load(f)
        return load_file(os.path.join(path, "adapter_model.safetensors")), cfg

    tensors, cfg = in_memory("all8")
    assert llm.add_lora(LoRARequest("trained", 42, tensors=tensors, peft_config=cfg))
    by_id = LoRARequest("trained", 42)  # later requests name the id alone
    assert _generate(llm, by_id) == list(_peft_greedy(tiny_models["llama"], adapters["all8"].lora_path))
    tensors, cfg = in_memory("mlp4")  # the next training step's weights, same id
    assert llm.add_lora(LoRARequest("trained", 42, tensors=tensors, peft_config=cfg))
    assert _generate(llm, by_id) == list(_peft_greedy(tiny_models["llama"], adapters["mlp4"].lora_path))
    assert 42 in llm.list_loras() and llm.pin_lora(42)
    assert _generate(llm, adapters["qv64"]) == list(_peft_greedy(tiny_models["llama"], adapters["qv64"].lora_path))
    assert llm.remove_lora(42) and 42 not in llm.list_loras()
    with pytest.raises(ValueError, match="not a known adapter"):
        _generate(llm, by_id)
