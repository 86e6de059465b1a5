"""N-gram prompt lookup (vLLM's ``method: "ngram"``): the request's own tokens are the draft.

The last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up
in everything before them; at the latest earlier occurrence, the k tokens that followed it are
the proposal. No model runs: code edits, quoting, summaries and extraction repeat their
input, and a repeated span is accepted whole in one target step.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedllm.config import SpeculativeConfig
from pagedllm.sampling_params import SamplingParams


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's sampling is exact under speculation here. Its per-position settings
    (temperature, top-k/p, min-p, logit bias, allowed tokens) apply to every verified position
    alike. Settings that read the output history or draw from a request's own RNG stream
    (penalties, min_tokens / bad words, logits processors, a seed) and per-token logprobs keep
    the request on one token per step, exact as without speculation."""
    return (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0
            and params.min_tokens == 0 and not params.bad_words_token_ids and not params.logits_processors
            and params.seed is None and params.logprobs is None)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_k: int | None = None) -> list[int]:
        """Up to ``min(k, max_k)`` tokens that followed the latest earlier occurrence of the
        longest suffix found; [] when no suffix recurs."""
        k = self.k if max_k is None else min(self.k, max_k)
        if k <= 0 or len(token_ids) < self.n_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            # Every window that starts before the suffix itself (so at least one token follows it).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
