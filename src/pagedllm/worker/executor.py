"""Executors: how the engine core reaches its worker(s) — in its own process (``uni``) or one
spawned process per tensor-parallel rank on this host (``mp``)."""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
import weakref
from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from multiprocessing.connection import wait as wait_for_ready
from typing import Any, Callable

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import ModelRunnerOutput, SchedulerOutput
from pagedllm.utils import freeze_gc_heap
from pagedllm.worker.worker import Worker

logger = logging.getLogger("pagedllm")

# How long start-up (model load, KV sizing) may take before the executor gives up on a worker.
WORKER_START_TIMEOUT_S = float(os.environ.get("PAGEDLLM_WORKER_START_TIMEOUT_S", "600"))
_POLL_S = 0.5  # how often a wait checks that every worker process is still alive


def _check_worker_method(method: str | Callable) -> None:
    if isinstance(method, str):
        func = getattr(Worker, method, None)
        if func is None or method.startswith("_") or not callable(func):
            raise ValueError(f"collective_rpc method {method!r} is not a public Worker method")
    elif not callable(method):
        raise ValueError(f"collective_rpc method must be a str or a callable, got {type(method).__name__}")


def _call_worker(worker: Worker, method: str | Callable, args: tuple, kwargs: dict | None) -> Any:
    if isinstance(method, str):
        return getattr(worker, method)(*args, **(kwargs or {}))
    return method(worker, *args, **(kwargs or {}))


def serve_call(worker: Worker, method: str | Callable, args: tuple, kwargs: dict | None, is_output_rank: bool) -> Any:
    """One executor call inside a worker process or actor. A step's output goes back from the
    output rank only: only the last stage samples, and its tensor ranks all sample the same tokens."""
    if method == "execute_model":
        result = worker.execute_model(args[0])
        return result if is_output_rank else None
    return _call_worker(worker, method, args, kwargs)


class UniProcExecutor:
    """The worker lives in the engine core's own process."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def kv_cache_bytes_per_block(self) -> int:
        return self.worker.model_runner.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput, non_block: bool = False):
        """The step's ModelRunnerOutput, or with ``non_block`` a handle whose result() waits."""
        return self.worker.execute_model(sched, non_block)

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on every worker (a Worker method's name, or a function taking the
        worker first); one result per worker, in rank order."""
        _check_worker_method(method)
        return [_call_worker(self.worker, method, args, kwargs)]

    def sleep(self, level: int) -> None:
        self.collective_rpc("sleep", (level,))

    def wake_up(self, tags: list[str]) -> None:
        self.collective_rpc("wake_up", (tags,))

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig):
    backend = config.parallel_config.distributed_executor_backend
    if backend == "mp":
        return MultiprocExecutor(config)
    if backend == "uni":
        return UniProcExecutor(config)
    if backend == "ray":
        from pagedllm.worker.ray_executor import RayExecutor  # ray is an optional extra

        return RayExecutor(config)
    raise ValueError(f"distributed_executor_backend must be 'uni', 'mp' or 'ray', got {backend!r}")


class WorkerFailedError(RuntimeError):
    """A worker process raised, died or never came up; the executor is unusable after it."""


class WorkerGroupExecutor:
    """What the multi-worker executors (mp, ray) share: every call goes to all ranks through
    ``_send`` (which returns a ticket) and comes back through ``_gather(ticket, what)``, one
    reply per rank in rank order, raising WorkerFailedError when a rank fails or dies."""

    output_rank: int  # whose ModelRunnerOutput the engine reads (the last stage's tensor rank 0)

    def _send(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise NotImplementedError

    def _gather(self, ticket: Any, what: str) -> list[Any]:
        raise NotImplementedError

    def _run(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        name = method if isinstance(method, str) else getattr(method, "__name__", "a function")
        return self._gather(self._send(method, args, kwargs), f"{name}()")

    def determine_num_blocks(self) -> int:
        return min(self._run("determine_num_blocks"))  # every rank must fit the same block count

    def kv_cache_bytes_per_block(self) -> int:
        return self._run("kv_cache_bytes_per_block")[0]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._run("initialize_kv_cache", (num_blocks,))

    def execute_model(self, sched: SchedulerOutput, non_block: bool = False):
        """The output rank's ModelRunnerOutput (the last stage's tensor ranks all sample the same
        tokens from the same all-gathered logits), or with ``non_block`` a handle whose
        result() waits for it: the workers run the step while the engine core goes on."""
        pending = _PendingStep(self, self._send("execute_model", (sched,)))
        return pending if non_block else pending.result()

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on every worker; one result per worker, in rank order. Iterators and
        dict views among the arguments (``state_dict().items()``) are listed first to be sent."""
        _check_worker_method(method)
        args = tuple(list(a) if isinstance(a, (Iterator, ItemsView, KeysView, ValuesView)) else a for a in args)
        return self._run(method, args, kwargs)

    def sleep(self, level: int) -> None:
        self.collective_rpc("sleep", (level,))

    def wake_up(self, tags: list[str]) -> None:
        self.collective_rpc("wake_up", (tags,))


class _PendingStep:
    def __init__(self, executor: WorkerGroupExecutor, ticket: Any) -> None:
        self.executor, self.ticket = executor, ticket
        self._result: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            # Every rank's reply is awaited: a failure anywhere is seen here, not in a later step.
            self._result = self.executor._gather(self.ticket, "execute_model()")[self.executor.output_rank]
        return self._result


class MultiprocExecutor(WorkerGroupExecutor):
    """One spawned worker process per rank (tensor x pipeline). Every call goes to all ranks
    (each step's SchedulerOutput included: the scheduler runs once, here); replies are read
    while watching the processes, so a worker that raises or dies makes the call raise at
    once (naming the rank) instead of hanging, and the other workers are stopped.

    ``execute_model(non_block=True)`` returns at once with a handle: the workers run the step
    while the engine core schedules the next one, so async scheduling still overlaps host and
    device work. Inside a worker each step is resolved before the next (its runner always
    knows the previous step's tokens)."""

    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.parallel_config.world_size
        self.output_rank = config.parallel_config.output_rank
        self.processes: list[mp.Process] = []
        self.conns: list = []
        self._seq = 0
        self._replies: list[dict[int, Any]] = [{} for _ in range(self.world_size)]
        self._failure: str | None = None
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self.conns)
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        try:
            with _children_allowed():
                for rank in range(self.world_size):
                    parent_conn, child_conn = ctx.Pipe()
                    process = ctx.Process(target=_worker_main, args=(config, rank, init_method, child_conn),
                                          name=f"pagedllm-worker-rank{rank}", daemon=True)
                    process.start()
                    child_conn.close()
                    self.processes.append(process)
                    self.conns.append(parent_conn)
            self._gather(-1, "start-up", timeout_s=WORKER_START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("Started %d worker processes (tensor_parallel_size=%d, pipeline_parallel_size=%d)",
                    self.world_size, config.parallel_config.tensor_parallel_size,
                    config.parallel_config.pipeline_parallel_size)

    # ---- calls to every worker ----------------------------------------------------------
    def _send(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> int:
        if self._failure is not None:
            raise WorkerFailedError(self._failure)
        self._seq += 1
        try:
            data = pickle.dumps((self._seq, method, args, kwargs))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise ValueError(f"the arguments of {getattr(method, '__name__', method)!r} cannot be sent to the "
                             f"worker processes (mp executor): {e}") from None
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                self._fail(f"worker rank {rank} is not reachable (pid {self.processes[rank].pid}, "
                           f"exit code {self.processes[rank].exitcode})")
        return self._seq

    def _gather(self, seq: int, what: str, timeout_s: float | None = None) -> list[Any]:
        """Every rank's reply to call ``seq``, in rank order; raises if any worker fails."""
        if self._failure is not None:
            raise WorkerFailedError(self._failure)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waiting = {rank for rank in range(self.world_size) if seq not in self._replies[rank]}
        while waiting:
            ready = wait_for_ready([self.conns[r] for r in waiting], timeout=_POLL_S)
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    reply_seq, ok, payload = conn.recv()
                except (EOFError, OSError):
                    continue  # the process is gone: reported by the liveness check below
                if not ok:
                    self._fail(f"worker rank {rank} failed during {what}:\n{payload}")
                self._replies[rank][reply_seq] = payload
                if reply_seq == seq:
                    waiting.discard(rank)
            for rank in sorted(waiting):
                process = self.processes[rank]
                if not process.is_alive():
                    self._fail(f"worker rank {rank} (pid {process.pid}) died with exit code {process.exitcode} "
                               f"during {what}")
            if waiting and deadline is not None and time.monotonic() > deadline:
                self._fail(f"worker rank(s) {sorted(waiting)} did not finish {what} within {timeout_s:.0f} s")
        return [self._replies[rank].pop(seq) for rank in range(self.world_size)]

    def _fail(self, message: str) -> None:
        """Remember the failure, stop every worker (no orphans, no peer stuck in a collective), raise."""
        self._failure = message
        _stop_workers(self.processes, self.conns, graceful=False)
        raise WorkerFailedError(message)

    def shutdown(self) -> None:
        """Stop every worker process (asked first, then terminated, then killed); idempotent."""
        self._finalizer()


@contextlib.contextmanager
def _children_allowed():
    """The server's engine core is a daemonic process, which multiprocessing forbids to start
    children. Ours are safe there: each exits when its pipe to this process closes, and
    shutdown (or the daemon cleanup at exit) stops them, so the flag is lifted while starting."""
    config = mp.current_process()._config
    was_daemon = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = was_daemon


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_workers(processes: list, conns: list, graceful: bool = True, timeout_s: float = 5.0) -> None:
    if graceful:
        for process, conn in zip(processes, conns):
            if process.is_alive():
                try:
                    conn.send_bytes(pickle.dumps((0, "shutdown", (), None)))
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + timeout_s
        for process in processes:
            process.join(max(deadline - time.monotonic(), 0.0))
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)
    for conn in conns:
        conn.close()


def _worker_main(config: EngineConfig, rank: int, init_method: str, conn) -> None:
    """A worker process: build the rank's Worker, then serve calls until told to stop or the
    engine's end of the pipe closes."""
    import sys

    import torch

    from pagedllm.distributed import destroy_distributed

    world_size = config.parallel_config.world_size
    if not torch.device(config.device).type == "cuda":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # the ranks share the cores
        if sys.platform == "linux":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname resolves to
    try:
        worker = Worker(config, rank, init_method)
    except BaseException:
        conn.send((-1, False, traceback.format_exc()))
        return
    freeze_gc_heap()
    conn.send((-1, True, None))
    while True:
        try:
            seq, method, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the engine is gone
        if method == "shutdown":
            break
        try:
            result = serve_call(worker, method, args, kwargs, rank == config.parallel_config.output_rank)
        except BaseException:
            conn.send((seq, False, traceback.format_exc()))
            continue
        conn.send((seq, True, result))
    destroy_distributed()
