"""LoggingStatLogger: the periodic throughput / queue / KV cache log line (vLLM's)."""
from __future__ import annotations

import logging
import time

from pagedllm import envs
from pagedllm.core.messages import SchedulerStats

logger = logging.getLogger("pagedllm")


def log_stats_interval_s() -> float:
    value = envs.PAGEDLLM_LOG_STATS_INTERVAL
    if value <= 0:
        raise ValueError(f"PAGEDLLM_LOG_STATS_INTERVAL must be > 0, got {value}")
    return value


class LoggingStatLogger:
    """Fed the engine's running token totals and the latest scheduler stats after each step;
    `log()` writes one line with the throughput since the last line. Idle periods stay quiet:
    a line is written while there is work, plus one more when it stops (showing 0 tokens/s)."""

    def __init__(self, interval_s: float | None = None, device: str = "cpu") -> None:
        # vLLM's wording on GPUs; a CPU engine's cache is in host memory.
        self.kv_label = "GPU KV cache" if device.startswith("cuda") else "KV cache"
        self.interval_s = interval_s if interval_s is not None else log_stats_interval_s()
        self.stats: SchedulerStats | None = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._last_time = time.monotonic()
        self._last_tokens = (0, 0)
        self._last_active = False

    def record(self, stats: SchedulerStats | None, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        if stats is not None:
            self.stats = stats
        self.num_prompt_tokens, self.num_generation_tokens = num_prompt_tokens, num_generation_tokens

    def maybe_log(self) -> None:
        """Log if an interval has passed since the last line (for callers without a timer)."""
        if time.monotonic() - self._last_time >= self.interval_s:
            self.log()

    def log(self) -> None:
        now = time.monotonic()
        dt = max(now - self._last_time, 1e-9)
        prompt_tokens = self.num_prompt_tokens - self._last_tokens[0]
        generation_tokens = self.num_generation_tokens - self._last_tokens[1]
        self._last_time, self._last_tokens = now, (self.num_prompt_tokens, self.num_generation_tokens)
        s = self.stats or SchedulerStats()
        active = bool(prompt_tokens or generation_tokens or s.num_running_reqs or s.num_waiting_reqs)
        if not (active or self._last_active):
            return
        self._last_active = active
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, %s usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt_tokens / dt, generation_tokens / dt, s.num_running_reqs, s.num_waiting_reqs, self.kv_label,
            100 * s.kv_cache_usage, 100 * hit_rate,
        )
        if s.spec_num_draft_tokens:
            logger.info(
                "Speculative decoding: %d drafted steps, acceptance rate %.1f%%, mean accepted per step %.2f, "
                "accepted per position %s", s.spec_num_drafts,
                100 * s.spec_num_accepted_tokens / s.spec_num_draft_tokens,
                s.spec_num_accepted_tokens / max(s.spec_num_drafts, 1), s.spec_accepted_per_pos)
