"""Tokenizer loading: Hugging Face tokenizers from a folder, a hub cache or a GGUF file."""
from __future__ import annotations

import logging
import os
from typing import Any

from pagedllm.config import ModelConfig
from pagedllm.model.gguf_cache import gguf_cache_dir

logger = logging.getLogger("pagedllm")


def get_tokenizer(model_config: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": model_config.trust_remote_code}
    if model_config.tokenizer_mode == "slow":
        kwargs["use_fast"] = False
    source = model_config.tokenizer or model_config.path
    if model_config.tokenizer is None and model_config.gguf_file is not None:
        cache = gguf_cache_dir(model_config.gguf_file)
        if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(cache, **kwargs)
        logger.info("Converting the GGUF tokenizer once (cached in %s)", cache)
        tok = AutoTokenizer.from_pretrained(os.path.dirname(model_config.gguf_file),
                                            gguf_file=os.path.basename(model_config.gguf_file), **kwargs)
        try:
            tok.save_pretrained(cache)
        except OSError as e:  # a read-only home still works, only slower to start
            logger.warning("Could not cache the GGUF tokenizer in %s: %s", cache, e)
        return tok
    if model_config.revision is not None and not os.path.isdir(source):
        kwargs["revision"] = model_config.revision
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not load a tokenizer from {source!r} ({e}); pass tokenizer=PATH, or "
            "skip_tokenizer_init=True and token-id prompts"
        ) from e
