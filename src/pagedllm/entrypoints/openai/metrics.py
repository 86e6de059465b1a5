"""Prometheus metrics of the server (`GET /metrics`), fed by AsyncLLM after every step."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.core.messages import SchedulerStats
from pagedllm.outputs import RequestOutput

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                            2.5, 5.0)


class ServerMetrics:
    """vLLM's metric set under the `pagedllm:` prefix, labelled with the served model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.labels = {"model_name": model_name}
        r, names = self.registry, ["model_name"]
        self.running = Gauge("pagedllm:num_requests_running", "Requests in the running batch.", names, registry=r)
        self.waiting = Gauge("pagedllm:num_requests_waiting", "Requests waiting to be scheduled.", names, registry=r)
        self.kv_usage = Gauge("pagedllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", names,
                              registry=r)
        self.prefix_queries = Counter("pagedllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      names, registry=r)
        self.prefix_hits = Counter("pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", names,
                                   registry=r)
        self.preemptions = Counter("pagedllm:num_preemptions", "Requests preempted (recomputed later).", names,
                                   registry=r)
        self.spec_drafts = Counter("pagedllm:spec_decode_num_drafts", "Steps that verified proposed tokens.", names,
                                   registry=r)
        self.spec_draft_tokens = Counter("pagedllm:spec_decode_num_draft_tokens", "Proposed tokens verified.", names,
                                         registry=r)
        self.spec_accepted = Counter("pagedllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", names,
                                     registry=r)
        self.spec_per_pos = Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Proposed tokens accepted, by position in the draft.", names + ["position"],
                                    registry=r)
        self.prompt_tokens = Counter("pagedllm:prompt_tokens", "Prompt tokens processed.", names, registry=r)
        self.generation_tokens = Counter("pagedllm:generation_tokens", "Tokens generated.", names, registry=r)
        self.finished = Counter("pagedllm:request_success", "Finished requests by finish reason.",
                                names + ["finished_reason"], registry=r)
        self.ttft = Histogram("pagedllm:time_to_first_token_seconds", "Time to first token.", names,
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("pagedllm:time_per_output_token_seconds", "Mean time per output token after the first.",
                              names, buckets=_TOKEN_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("pagedllm:e2e_request_latency_seconds", "Arrival to finish.", names,
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue = Histogram("pagedllm:request_queue_time_seconds", "Arrival to first scheduling.", names,
                               buckets=_LATENCY_BUCKETS_S, registry=r)
        self._last_cumulative = {"queries": 0, "hits": 0, "preemptions": 0, "prompt": 0, "generation": 0,
                                 "spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted": 0}
        self._last_per_pos: list[int] = []
        # Export every series from the start (at 0), so a scrape never misses one.
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                       self.preemptions, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted, self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e,
                       self.queue):
            metric.labels(**self.labels)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(**self.labels, finished_reason=reason)

    def _advance(self, key: str, total: int, counter: Counter) -> None:
        """Counters move by the growth of the engine's running totals."""
        delta = total - self._last_cumulative[key]
        if delta > 0:
            counter.labels(**self.labels).inc(delta)
            self._last_cumulative[key] = total

    def on_step(self, stats: SchedulerStats | None, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self._advance("prompt", num_prompt_tokens, self.prompt_tokens)
        self._advance("generation", num_generation_tokens, self.generation_tokens)
        if stats is None:
            return
        self.running.labels(**self.labels).set(stats.num_running_reqs)
        self.waiting.labels(**self.labels).set(stats.num_waiting_reqs)
        self.kv_usage.labels(**self.labels).set(stats.kv_cache_usage)
        self._advance("queries", stats.prefix_cache_queries, self.prefix_queries)
        self._advance("hits", stats.prefix_cache_hits, self.prefix_hits)
        self._advance("preemptions", stats.num_preemptions, self.preemptions)
        if stats.spec_num_drafts:
            self._advance("spec_drafts", stats.spec_num_drafts, self.spec_drafts)
            self._advance("spec_draft_tokens", stats.spec_num_draft_tokens, self.spec_draft_tokens)
            self._advance("spec_accepted", stats.spec_num_accepted_tokens, self.spec_accepted)
            for pos, total in enumerate(stats.spec_accepted_per_pos):
                last = self._last_per_pos[pos] if pos < len(self._last_per_pos) else 0
                if total > last:
                    self.spec_per_pos.labels(**self.labels, position=str(pos)).inc(total - last)
            self._last_per_pos = list(stats.spec_accepted_per_pos)

    def on_finished(self, output: RequestOutput) -> None:
        if isinstance(output.outputs, list):
            reason = next((c.finish_reason for c in output.outputs if c.finish_reason), "abort")
        else:  # a pooling request's one output
            reason = "stop" if output.finished and output.outputs.data is not None else "abort"
        self.finished.labels(**self.labels, finished_reason=reason).inc()
        m = output.metrics
        if m is None:
            return
        if m.finished_time is not None:
            self.e2e.labels(**self.labels).observe(m.finished_time - m.arrival_time)
        if m.time_in_queue is not None:
            self.queue.labels(**self.labels).observe(m.time_in_queue)
        if m.first_token_time is not None:
            self.ttft.labels(**self.labels).observe(m.first_token_time - m.arrival_time)
            if m.last_token_time is not None and m.num_generation_tokens > 1:
                self.tpot.labels(**self.labels).observe(
                    (m.last_token_time - m.first_token_time) / (m.num_generation_tokens - 1))

    def on_aborted(self, num_requests: int) -> None:
        if num_requests:
            self.finished.labels(**self.labels, finished_reason="abort").inc(num_requests)

    def set_queue_gauges(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Fresh values read from the engine core at scrape time: after aborts the engine may
        take no further step, and the per-step values would stay stale while it idles."""
        self.running.labels(**self.labels).set(num_running)
        self.waiting.labels(**self.labels).set(num_waiting)
        self.kv_usage.labels(**self.labels).set(kv_cache_usage)

    def render(self) -> Any:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
