"""Structured outputs: grammar backends, the compile pool and cache, per-request matchers, the logits bitmask."""
