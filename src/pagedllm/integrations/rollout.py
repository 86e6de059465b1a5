"""RolloutEngine: pagedllm as an RL rollout engine, configured the way ROLL configures vLLM.

A ROLL-style YAML holds ``strategy_args.strategy_config`` (engine arguments plus ``sleep_level``)
and ``generating_args`` (Hugging Face ``generate`` names)::

    engine = RolloutEngine.from_strategy_config(model_dir, cfg["strategy_args"]["strategy_config"])
    for step in range(num_steps):
        engine.load()                                  # wake_up (no-op when awake)
        engine.update_weights(trainer.state_dict().items())
        groups = engine.generate(prompts, cfg["generating_args"])
        engine.offload()                               # sleep(sleep_level): the trainer gets the memory

``sleep_level`` (ROLL's key; not an engine argument, so it is popped here, as ROLL's vLLM
strategy does) is 1 by default, as in ROLL: the engine is created with ``enable_sleep_mode``
and offload() sleeps at that level; 0 means never sleep.
"""
from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.llm import LLM
from pagedllm.inputs import PromptType
from pagedllm.sampling_params import SamplingParams

# generating_args key (HF generate's name) -> SamplingParams field
_GENERATING_ARGS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "num_return_sequences": "n",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "stop_strings": "stop",
    "eos_token_id": "stop_token_ids",
    "seed": "seed",
    "logprobs": "logprobs",
    "ignore_eos": "ignore_eos",
}
_STRATEGY_ONLY_KEYS = ("VLLM_USE_V1",)  # ROLL passes it to vLLM's environment; nothing to do here


@dataclass
class RolloutSample:
    token_ids: list[int]
    text: str
    logprobs: list[float] | None  # log-probability of each sampled token (with logprobs set)
    finish_reason: str | None  # "stop" | "length" | "abort"


@dataclass
class RolloutGroup:
    """The ``num_return_sequences`` samples of one prompt."""
    prompt_token_ids: list[int]
    samples: list[RolloutSample]


def sampling_params_from_generating_args(generating_args: Mapping[str, Any]) -> SamplingParams:
    """Map HF-style generating_args to SamplingParams. ``do_sample=False`` means greedy;
    ``num_beams`` must be 1 (no beam search); any other key is a ValueError naming it."""
    args = dict(generating_args)
    do_sample = args.pop("do_sample", True)
    num_beams = args.pop("num_beams", 1)
    if num_beams != 1:
        raise ValueError(f"generating_args num_beams must be 1 (beam search is not supported), got {num_beams!r}")
    unknown = sorted(set(args) - set(_GENERATING_ARGS))
    if unknown:
        raise ValueError(f"unknown generating_args key(s) {unknown}; supported: "
                         f"{sorted([*_GENERATING_ARGS, 'do_sample', 'num_beams'])}")
    kwargs = {_GENERATING_ARGS[k]: v for k, v in args.items() if v is not None}
    if isinstance(kwargs.get("stop_token_ids"), int):
        kwargs["stop_token_ids"] = [kwargs["stop_token_ids"]]
    if isinstance(kwargs.get("stop"), str):
        kwargs["stop"] = [kwargs["stop"]]
    if not do_sample:
        kwargs["temperature"] = 0.0
    return SamplingParams(**kwargs)


_RANGE_EXPR = re.compile(r"^\s*list\s*\(\s*range\s*\(\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?)?\)\s*\)\s*$")


def parse_device_mapping(mapping: Sequence[int] | str) -> list[int]:
    """ROLL's ``device_mapping``: a list of GPU indices, or the string ROLL's YAML configs use,
    ``"list(range(0,8))"`` or ``"[0, 1]"`` (parsed, never evaluated)."""
    if isinstance(mapping, str):
        m = _RANGE_EXPR.match(mapping)
        if m:
            args = [int(x) for x in m.groups() if x is not None]
            return list(range(*args))
        try:
            mapping = ast.literal_eval(mapping.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"device_mapping {mapping!r} must be a list of GPU indices or 'list(range(a, b))'") \
                from None
    if not isinstance(mapping, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                         for i in mapping):
        raise ValueError(f"device_mapping must be a list of GPU indices, got {mapping!r}")
    return list(mapping)


class RolloutEngine:
    """An LLM plus the sleep level to use between rollouts."""

    def __init__(self, llm: LLM, sleep_level: int = 1) -> None:
        self.llm = llm
        self.sleep_level = sleep_level

    @classmethod
    def from_strategy_config(cls, model: str | None, strategy_config: Mapping[str, Any],
                             device_mapping: Sequence[int] | str | None = None) -> "RolloutEngine":
        """``LLM(model, **strategy_config)`` without ROLL's own keys: ``sleep_level`` (0, 1 or 2;
        default 1) turns on ``enable_sleep_mode`` unless the config sets it. ``device_mapping``
        (ROLL's worker key: the GPUs this engine's ranks run on, among the visible ones) gives
        one GPU per rank; with one GPU it alone sets ``tensor_parallel_size`` when the config
        does not, as ROLL's vLLM strategy does with one worker."""
        config = dict(strategy_config)
        if device_mapping is not None:
            ids = parse_device_mapping(device_mapping)
            config["device_ids"] = ids
            if "tensor_parallel_size" not in config and "pipeline_parallel_size" not in config:
                config["tensor_parallel_size"] = len(ids)
        sleep_level = config.pop("sleep_level", 1)
        for key in _STRATEGY_ONLY_KEYS:
            config.pop(key, None)
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level must be 0 (never sleep), 1 or 2, got {sleep_level!r}")
        config.setdefault("enable_sleep_mode", sleep_level > 0)
        if sleep_level and not config["enable_sleep_mode"]:
            raise ValueError(f"sleep_level={sleep_level} needs enable_sleep_mode=True (or leave it out)")
        return cls(LLM(model, **config), sleep_level)

    def generate(self, prompts: Sequence[PromptType], generating_args: Mapping[str, Any] | SamplingParams,
                 use_tqdm: bool = False) -> list[RolloutGroup]:
        """One group of ``num_return_sequences`` samples per prompt, in prompt order."""
        params = generating_args if isinstance(generating_args, SamplingParams) \
            else sampling_params_from_generating_args(generating_args)
        outputs = self.llm.generate(list(prompts), params, use_tqdm=use_tqdm)
        groups = []
        for out in outputs:
            samples = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                logprobs = None
                if c.logprobs is not None:
                    logprobs = [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs)]
                samples.append(RolloutSample(list(c.token_ids), c.text, logprobs, c.finish_reason))
            groups.append(RolloutGroup(list(out.prompt_token_ids), samples))
        return groups

    def offload(self) -> None:
        """Give the device memory back to the trainer: sleep(sleep_level); nothing at level 0."""
        if self.sleep_level and not self.llm.is_sleeping():
            self.llm.sleep(self.sleep_level)

    def load(self, tags: list[str] | None = None) -> None:
        """wake_up(tags); after sleep level 2 the weights must be updated before generating."""
        if self.llm.is_sleeping():
            self.llm.wake_up(tags)

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """HF-named (name, tensor) pairs into the model; the prefix cache is reset."""
        self.llm.update_weights(named_tensors)
