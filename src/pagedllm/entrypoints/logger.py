"""RequestLogger: the server's one INFO line per request as it arrives (vLLM's)."""
from __future__ import annotations

import logging
from typing import Optional

from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class RequestLogger:
    def __init__(self, max_log_len: Optional[int] = None) -> None:
        self.max_log_len = max_log_len  # characters of the prompt and entries of its token ids; None: all

    def log_inputs(self, request_id: str, prompt: Optional[str], prompt_token_ids: Optional[list[int]],
                   params: SamplingParams) -> None:
        if self.max_log_len is not None:
            prompt = prompt[:self.max_log_len] if prompt is not None else None
            prompt_token_ids = prompt_token_ids[:self.max_log_len] if prompt_token_ids is not None else None
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id, prompt, params,
                    prompt_token_ids)
