"""The Executor protocol (how the engine core reaches its workers) and the pieces the executors share."""
from __future__ import annotations

import abc
import traceback
from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from typing import Any, Callable, Union

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.ops.cpu_linear import forget_packed
from pagedllm.worker.worker import Worker

# A Worker method's name, or a function called as ``f(worker, *args, **kwargs)``.
WorkerMethod = Union[str, Callable[..., Any]]


class WorkerFailedError(RuntimeError):
    """A worker process raised, died or never came up; the executor is unusable after it."""


def check_worker_method(method: WorkerMethod) -> None:
    """A user's collective_rpc target: a public Worker method's name, or a callable."""
    if isinstance(method, str):
        func = getattr(Worker, method, None)
        if func is None or method.startswith("_") or not callable(func):
            raise ValueError(f"collective_rpc method {method!r} is not a public Worker method")
    elif not callable(method):
        raise ValueError(f"collective_rpc method must be a str or a callable, got {type(method).__name__}")


def call_worker(worker: Worker, method: WorkerMethod, args: tuple, kwargs: dict | None) -> Any:
    try:
        if isinstance(method, str):
            return getattr(worker, method)(*args, **(kwargs or {}))
        return method(worker, *args, **(kwargs or {}))
    finally:
        if not isinstance(method, str) or method in _WRITES_WEIGHTS:
            forget_packed()  # CPU linears' packed weight copies (ops/cpu_linear.py) may be stale


# Worker methods that may write weights in place (a collective_rpc function may too).
_WRITES_WEIGHTS = frozenset({"load_weights", "sleep", "wake_up"})


def serve_call(worker: Worker, method: WorkerMethod, args: tuple, kwargs: dict | None, is_output_rank: bool) -> Any:
    """One executor call inside a worker process or actor. A step's output goes back from the
    output rank only: only the last stage samples, and its tensor ranks all sample the same tokens."""
    if method in ("execute_model", "sample_tokens"):  # a defer_grammar step's output comes with sample_tokens
        result = getattr(worker, method)(args[0])
        return result if is_output_rank else None
    return call_worker(worker, method, args, kwargs)


def outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[bool, Any]:
    """How a worker process or actor answers a call: (True, ``fn``'s result) or (False, the
    traceback of what it raised), which the executor turns into a WorkerFailedError."""
    try:
        return True, fn(*args, **kwargs)
    except BaseException:
        return False, traceback.format_exc()


def finish_step(pending, is_output_rank: bool) -> tuple[bool, Any]:
    """A step launched with non_block, waited for, as a worker replies: (True, its output; the
    output rank's only, as serve_call returns it) or (False, the traceback)."""
    ok, output = outcome(pending.result)
    return ok, output if (is_output_rank or not ok) else None


class Executor(abc.ABC):
    """How the engine core reaches its worker(s). Every call to all workers travels one path,
    ``collective_rpc`` (the engine's own calls skip only the check of the method name); the step
    has its own call because it may return before the workers finish. Implemented by
    UniProcExecutor (the worker in this process), MultiprocExecutor (one process per rank) and
    RayExecutor (one Ray actor per rank)."""

    output_rank: int = 0  # whose ModelRunnerOutput the engine reads (the last stage's tensor rank 0)

    @abc.abstractmethod
    def _run_on_workers(self, method: WorkerMethod, args: tuple, kwargs: dict | None) -> list[Any]:
        """Call ``method`` on every worker; one result per worker, in rank order."""

    @abc.abstractmethod
    def execute_model(self, sched: SchedulerOutput, non_block: bool = False):
        """The step's ModelRunnerOutput, or with ``non_block`` a handle whose result() waits."""

    @abc.abstractmethod
    def sample_tokens(self, grammar) -> None:
        """Finish the step launched (non_block) with ``defer_grammar``: its constrained rows are
        masked by ``grammar`` (a GrammarBitmask, or None) and sampled; the handle that
        ``execute_model`` returned for it now waits for that."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers; idempotent."""

    def collective_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on every worker (a public Worker method's name, or a function taking the
        worker first); one result per worker, in rank order."""
        check_worker_method(method)
        return self._run_on_workers(method, tuple(args), kwargs)

    def determine_num_blocks(self) -> int:
        return min(self._run_on_workers("determine_num_blocks", (), None))  # every rank must fit the same count

    def kv_cache_bytes_per_block(self) -> int:
        return self._run_on_workers("kv_cache_bytes_per_block", (), None)[0]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._run_on_workers("initialize_kv_cache", (num_blocks,), None)


class WorkerGroupExecutor(Executor):
    """What the multi-worker executors (mp, ray) share: every call goes to all ranks through
    ``_send`` (which returns a ticket) and comes back through ``_gather(ticket, what)``, one
    reply per rank in rank order, raising WorkerFailedError when a rank fails or dies."""

    _deferred: "PendingStep | None" = None  # a defer_grammar step's handle until sample_tokens()

    @abc.abstractmethod
    def _send(self, method: WorkerMethod, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Send the call to every rank; returns the ticket ``_gather`` waits on."""

    @abc.abstractmethod
    def _gather(self, ticket: Any, what: str) -> list[Any]:
        """Every rank's reply to ``ticket``, in rank order."""

    def _run_on_workers(self, method: WorkerMethod, args: tuple, kwargs: dict | None) -> list[Any]:
        # Iterators and dict views (``state_dict().items()``) are listed first to be sent.
        args = tuple(list(a) if isinstance(a, (Iterator, ItemsView, KeysView, ValuesView)) else a for a in args)
        name = method if isinstance(method, str) else getattr(method, "__name__", "a function")
        return self._gather(self._send(method, args, kwargs), f"{name}()")

    def execute_model(self, sched: SchedulerOutput, non_block: bool = False):
        """The output rank's ModelRunnerOutput (the last stage's tensor ranks all sample the same
        tokens from the same all-gathered logits), or with ``non_block`` a handle whose
        result() waits for it: the workers run the step while the engine core goes on."""
        ticket = self._send("execute_model", (sched,))
        if sched.defer_grammar:  # the output comes with sample_tokens(), sent once the masks are known
            if not non_block:
                raise ValueError("a defer_grammar step must be launched with non_block=True")
            self._deferred = PendingStep(lambda: self._gather(ticket, "execute_model()"))
            return self._deferred
        pending = PendingStep(lambda: self._gather(ticket, "execute_model()")[self.output_rank])
        return pending if non_block else pending.result()

    def sample_tokens(self, grammar) -> None:
        pending, self._deferred = self._deferred, None
        if pending is None:
            raise RuntimeError("sample_tokens() without a step launched with defer_grammar")
        ticket = self._send("sample_tokens", (grammar,))
        launched = pending._wait  # every rank's reply to execute_model (None) is read first: failures show

        def wait() -> ModelRunnerOutput:
            launched()
            return self._gather(ticket, "sample_tokens()")[self.output_rank]

        pending._wait = wait


class PendingStep:
    """A launched step: ``result()`` waits for its ModelRunnerOutput (once; later calls return it)."""

    def __init__(self, wait: Callable[[], ModelRunnerOutput]) -> None:
        self._wait = wait
        self._result: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            # Every rank's reply is awaited: a failure anywhere is seen here, not in a later step.
            self._result = self._wait()
        return self._result
