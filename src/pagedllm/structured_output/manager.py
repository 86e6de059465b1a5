"""StructuredOutputManager: compiles grammars off the engine loop and fills each step's bitmask.

Owned by the engine core beside the scheduler. A constrained request gets a ``GrammarRequest``
(attached to the scheduler's ``Request``): its grammar compiles in a thread pool, through a
cache keyed by (backend, kind, spec, options), while the request waits and the others keep
running; once ready it holds the request's matcher, which follows every accepted token.
Each step, the rows of the constrained requests that sample fill one packed int32 bitmask
(``GrammarBitmask``, carried to the workers in the ``SchedulerOutput``).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable

import numpy as np

from pagedllm.config import StructuredOutputsConfig
from pagedllm.reasoning import ReasoningParserManager
from pagedllm.structured_output.backends import BACKEND_CLASSES, Matcher, _first_line
from pagedllm.structured_params import StructuredOutputsParams

logger = logging.getLogger("pagedllm")

_CACHE_ENTRIES = 256  # compiled grammars kept (LRU)


class GrammarBitmask:
    """One step's masks: row i (int32 words, bit set = token allowed) belongs to ``req_ids[i]``.

    Filled when first read (``fill``), so that a worker in the engine's process reads it after
    it has launched the step's forward: the host fills the masks while the device computes.
    Sent to another process, it is filled before it goes (``__getstate__``)."""

    def __init__(self, req_ids: list[str], bitmask: np.ndarray | None = None,
                 fill: Callable[[np.ndarray | None], np.ndarray] | None = None, words: int | None = None) -> None:
        self.req_ids = req_ids
        self._bitmask, self._fill = bitmask, fill
        self.words = bitmask.shape[1] if bitmask is not None else words  # int32 words per row

    @property
    def bitmask(self) -> np.ndarray:  # [len(req_ids), ceil(vocab / 32)] int32
        if self._bitmask is None:
            self._bitmask, self._fill = self._fill(None), None
        return self._bitmask

    def fill_into(self, out: np.ndarray) -> np.ndarray:
        """The masks written into ``out`` (a pinned staging buffer: no copy when not yet filled)."""
        if self._bitmask is None:
            self._bitmask, self._fill = self._fill(out), None
        elif self._bitmask is not out:
            out[:] = self._bitmask
        return out

    def __getstate__(self) -> dict:
        return {"req_ids": self.req_ids, "_bitmask": self.bitmask, "_fill": None, "words": self.words}


class GrammarRequest:
    """One request's grammar: compiling, then ready (a matcher), or failed (``error``)."""

    def __init__(self, manager: "StructuredOutputManager", request_id: str, params: StructuredOutputsParams,
                 future: concurrent.futures.Future, prompt_token_ids: list[int] | None = None) -> None:
        self.manager, self.request_id, self.params = manager, request_id, params
        self.future = future
        self.submitted_at = time.monotonic()
        self.matcher: Matcher | None = None
        self.error: str | None = None
        self.num_accepted = 0
        # Under a reasoning parser the constraint waits for the reasoning's end (set when ready).
        self._prompt_token_ids = prompt_token_ids
        self.reasoning_ended = True

    def is_ready(self) -> bool:
        return self.matcher is not None

    def _resolve(self, now: float) -> bool:
        """Compiled, failed or timed out: returns True when the request stops waiting."""
        field = f"structured_outputs.{self.params.kind}"
        if self.future.done():
            exc = self.future.exception()
            if exc is not None:
                self.error = f"{field} could not be compiled: {_first_line(exc)}"
            else:
                self.matcher = self.manager.backend(self.params._backend).matcher(self.future.result())
                reasoner = self.manager.reasoner
                if reasoner is not None:
                    self.reasoning_ended = reasoner.prompt_ends_reasoning(self._prompt_token_ids or [])
                self._prompt_token_ids = None
            return True
        timeout = self.manager.config.compile_timeout_s
        if now - self.submitted_at > timeout:
            self.error = (f"{field} took longer than compile_timeout_s={timeout:g} s to compile; simplify it "
                          "or raise structured_outputs_config's compile_timeout_s")
            return True
        return False

    def see_reasoning_token(self, token_id: int) -> None:
        """A token sampled while the reasoning runs (unconstrained): the end tag starts the constraint."""
        if token_id == self.manager.reasoner.end_token_id:
            self.reasoning_ended = True

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        """Advance over tokens the request sampled; False if the grammar refuses one."""
        for token_id in token_ids:
            if not self.matcher.accept_token(token_id):
                return False
            self.num_accepted += 1
        return True

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding's rejected drafts)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {self.num_accepted} were accepted")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_bitmask(bitmask, row)

    def free(self) -> None:
        """The request finished or was aborted: drop the matcher."""
        self.matcher = None
        self.manager.live.pop(self.request_id, None)
        self.manager.pending.pop(self.request_id, None)


class StructuredOutputManager:
    """The compile pool, the compiled-grammar cache and the requests' grammars."""

    def __init__(self, config: StructuredOutputsConfig, vocab_size: int, tokenizer_factory: Callable[[], Any],
                 stop_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._tokenizer_factory = tokenizer_factory
        self._stop_token_ids = sorted(set(stop_token_ids))
        self._backends: dict[str, Any] = {}
        self._batch_fillers: dict[type, Any] = {}  # a matcher class → its backend's parallel filler
        self.fill_seconds, self.fill_steps, self.fill_rows = 0.0, 0, 0  # host time filling masks (benchmarks)
        # The reasoning parser whose end tag starts each constraint (None: constraints start at once).
        self._reasoner_cls = (ReasoningParserManager.get_reasoning_parser(config.reasoning_parser)
                              if config.reasoning_parser and not config.enable_in_reasoning else None)
        self.reasoner: Any = None
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self.live: dict[str, GrammarRequest] = {}  # every request holding a grammar (compiling or ready)
        self.pending: dict[str, GrammarRequest] = {}  # those still compiling
        self.words = -(-vocab_size // 32)

    # ---- compile --------------------------------------------------------------------------------
    def backend(self, name: str) -> Any:
        """The backend ``name``, built on first use (loads the tokenizer; may run in the pool)."""
        with self._lock:
            if name not in self._backends:
                tokenizer = self._tokenizer_factory()
                stops = list(self._stop_token_ids)
                if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
                    stops.insert(0, tokenizer.eos_token_id)
                # A padded model vocabulary is wider than the tokenizer's (the extra ids are never
                # allowed); a tokenizer with more ids than the model's logits gets a wider mask, of
                # which the runner reads the logits' width.
                vocab = max(self.vocab_size, len(tokenizer))
                if self._reasoner_cls is not None and self.reasoner is None:
                    reasoner = self._reasoner_cls(tokenizer)
                    if reasoner.end_token_id is None:
                        raise ValueError(f"reasoning parser {self.config.reasoning_parser!r}: the tokenizer has no "
                                         f"{reasoner.end_tag!r} token, so a constraint could never start")
                    self.reasoner = reasoner
                self._backends[name] = BACKEND_CLASSES[name](tokenizer, vocab, stops)
                self.words = -(-vocab // 32)
            return self._backends[name]

    def _compile(self, params: StructuredOutputsParams) -> Any:
        return self.backend(params._backend).compile(params)

    def add_request(self, request_id: str, params: StructuredOutputsParams,
                    prompt_token_ids: list[int] | None = None) -> GrammarRequest:
        """Start (or join, or reuse) the compile of the request's grammar; returns its handle."""
        key = (params._backend, params.kind, params.spec_text(), params.options())
        future = self._cache.get(key)
        if future is None:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.config.max_compile_threads,
                                                                   thread_name_prefix="pagedllm-grammar")
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        prompt = list(prompt_token_ids or []) if self._reasoner_cls is not None else None
        handle = GrammarRequest(self, request_id, params, future, prompt)
        self.live[request_id] = handle
        self.pending[request_id] = handle
        return handle

    def poll(self) -> list[GrammarRequest]:
        """Settle the compiles that finished; returns the requests whose grammar failed (an
        error or the compile timeout). Called by the engine core before each schedule."""
        if not self.pending:
            return []
        now, failed = time.monotonic(), []
        for req_id, handle in list(self.pending.items()):
            if handle._resolve(now):
                del self.pending[req_id]
                if handle.error is not None:
                    failed.append(handle)
        return failed

    def wait(self, timeout: float) -> None:
        """Nothing else to run: sleep until a compile finishes (or ``timeout``), not spin."""
        futures = [h.future for h in self.pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    # ---- each step ------------------------------------------------------------------------------
    def bitmask(self, handles: list[GrammarRequest]) -> GrammarBitmask | None:
        """The masks of the constrained requests that sample this step (None: there are none),
        filled when the worker reads them."""
        if not handles:
            return None
        return GrammarBitmask([h.request_id for h in handles], fill=lambda out: self._fill(handles, out),
                              words=self.words)

    def _fill(self, handles: list[GrammarRequest], out: np.ndarray | None = None) -> np.ndarray:
        """Each backend's matchers fill their rows together on several threads (xgrammar's batch
        fill, llguidance's executor); a lone row, or a backend without one, fills directly."""
        start = time.perf_counter()
        bitmask = np.empty((len(handles), self.words), dtype=np.int32) if out is None else out
        by_class: dict[type, list[int]] = {}
        for row, handle in enumerate(handles):
            by_class.setdefault(type(handle.matcher), []).append(row)
        for cls, rows in by_class.items():
            factory = getattr(cls, "batch_filler", None)
            if factory is None or len(rows) == 1:
                for row in rows:
                    handles[row].fill_bitmask(bitmask, row)
                continue
            filler = self._batch_fillers.get(cls)
            if filler is None:
                filler = self._batch_fillers[cls] = factory(min(self.config.max_fill_threads, os.cpu_count() or 1))
            filler.fill([handles[row].matcher for row in rows], bitmask, rows)
        self.fill_seconds += time.perf_counter() - start
        self.fill_steps += 1
        self.fill_rows += len(handles)
        return bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
