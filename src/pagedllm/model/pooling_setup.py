"""Which runner a model gets and how it pools (vLLM's ``runner`` / ``convert`` / ``task`` and
``pooler_config``), from the engine args, the architecture and sentence-transformers' files."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from typing import Any

from pagedllm.config import PoolerConfig
from pagedllm.model.registry import ENCODER_ARCHITECTURES, POOLING_ARCHITECTURES, SUPPORTED_ARCHITECTURES

logger = logging.getLogger("pagedllm")

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")
# vLLM's older ``task`` -> (runner, convert)
TASKS = {"auto": ("auto", "auto"), "generate": ("generate", "auto"), "embed": ("pooling", "embed"),
         "embedding": ("pooling", "embed"), "classify": ("pooling", "classify"), "score": ("pooling", "auto"),
         "reward": ("pooling", "reward")}
# sentence-transformers' 1_Pooling/config.json modes -> our pooling types
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}


def resolve_pooling(hf_config: Any, path: str, runner: str, convert: str, task: str | None,
                    pooler_config: dict | PoolerConfig | None) -> tuple[str, str, PoolerConfig | None, bool, str | None]:
    """Returns (runner_type, convert, pooler config or None, is_encoder, pooling kind or None)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {list(CONVERTS)}, got {convert!r}")
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
        t_runner, t_convert = TASKS[task]
        runner = t_runner if runner == "auto" else runner
        convert = t_convert if convert == "auto" else convert
    archs = list(getattr(hf_config, "architectures", None) or [])
    pooling_arch = next((a for a in archs if a in POOLING_ARCHITECTURES), None)
    st_modules = _read_json(os.path.join(path, "modules.json"))
    if runner == "auto":
        runner = "pooling" if pooling_arch or (st_modules is not None and convert != "none") else "generate"
    if runner == "generate":
        if pooling_arch and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"{pooling_arch} is a pooling model: it cannot generate (use runner='pooling', "
                             "LLM.embed / LLM.classify / LLM.score)")
        if pooler_config:
            raise ValueError("pooler_config applies to pooling models only (runner='pooling')")
        return "generate", "none", None, False, None
    if pooling_arch:
        kind = POOLING_ARCHITECTURES[pooling_arch].pooling_kind
        if convert not in ("auto", "none", kind):
            raise ValueError(f"{pooling_arch} is a {kind} model; convert={convert!r} does not apply")
        convert = "none"
    else:
        if convert in ("auto", "none"):
            convert = "embed"
        kind = convert
    cfg = pooler_config if isinstance(pooler_config, PoolerConfig) else PoolerConfig.from_dict(pooler_config)
    cfg = _sentence_transformers_defaults(path, st_modules, cfg) if kind == "embed" else cfg
    if cfg.pooling_type is None:
        cls = POOLING_ARCHITECTURES.get(pooling_arch)
        cfg = replace(cfg, pooling_type=getattr(cls, "default_pooling", None) or
                      {"embed": "LAST", "classify": "LAST", "reward": "ALL"}[kind])
    if cfg.dimensions is not None and cfg.matryoshka_dimensions is None:
        cfg.matryoshka_dimensions = [cfg.dimensions]
    mrl = getattr(hf_config, "matryoshka_dimensions", None)
    if cfg.matryoshka_dimensions is None and mrl:
        cfg.matryoshka_dimensions = list(mrl)
    if getattr(hf_config, "is_matryoshka", False) and cfg.matryoshka_dimensions is None:
        cfg.matryoshka_dimensions = list(range(1, hf_config.hidden_size + 1))
    return "pooling", convert, cfg, pooling_arch in ENCODER_ARCHITECTURES, kind


def _read_json(path: str) -> Any | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _sentence_transformers_defaults(path: str, modules: list | None, cfg: PoolerConfig) -> PoolerConfig:
    """A sentence-transformers folder names its pooling (1_Pooling/config.json) and whether it
    normalises (a Normalize module); what the user set wins."""
    if modules is None:
        return cfg
    updates: dict[str, Any] = {}
    for module in modules:
        kind = module.get("type", "")
        if kind.rsplit(".", 1)[-1] not in ("Transformer", "Pooling", "Normalize"):
            raise ValueError(f"sentence-transformers module {kind!r} is not supported (supported: Transformer, "
                             "Pooling, Normalize)")
        if kind.endswith("Pooling") and cfg.pooling_type is None:
            st = _read_json(os.path.join(path, module.get("path", ""), "config.json")) or {}
            modes = [ours for key, ours in _ST_MODES.items() if st.get(key)]
            other = [k for k, v in st.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
            mode = st.get("pooling_mode")  # sentence-transformers 6 names one mode
            if isinstance(mode, str):
                modes.append(_ST_MODES.get(f"pooling_mode_{mode}_token" if mode == "cls" else
                                           f"pooling_mode_{mode}_tokens" if mode == "mean" else
                                           f"pooling_mode_{mode}", mode))
                if modes[-1] not in ("CLS", "MEAN", "LAST"):
                    other.append(mode)
            if st.get("include_prompt") is False:
                other.append("include_prompt=False")
            if other or len(modes) > 1:
                raise ValueError(f"sentence-transformers pooling {other or modes} is not supported; supported: "
                                 "one of cls_token, mean_tokens, lasttoken")
            if modes:
                updates["pooling_type"] = modes[0]
    if cfg.use_activation is None:
        updates["use_activation"] = any(m.get("type", "").endswith("Normalize") for m in modules)
    return replace(cfg, **updates)
