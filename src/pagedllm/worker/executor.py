"""The ``uni`` executor (the worker in the engine core's process), the ``mp`` one (a spawned
process per rank on this host), and ``create_executor``, which picks one (or the ``ray`` one)."""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import socket
import time
import weakref
from multiprocessing.connection import wait as wait_for_ready
from typing import Any

import torch

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.utils import freeze_gc_heap, rare_full_collections
from pagedllm.worker.executor_base import (
    Executor,
    WorkerFailedError,
    WorkerGroupExecutor,
    WorkerMethod,
    call_worker,
    finish_step,
    outcome,
    serve_call,
)
from pagedllm.worker.worker import Worker

logger = logging.getLogger("pagedllm")

_POLL_S = 0.5  # how often a wait checks that every worker process is still alive
_SPIN_S = 50e-6  # a worker with a step in flight checks for the engine's next call and the step's tokens


class UniProcExecutor(Executor):
    """The worker lives in the engine core's own process."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)

    def _run_on_workers(self, method: WorkerMethod, args: tuple, kwargs: dict | None) -> list[Any]:
        return [call_worker(self.worker, method, args, kwargs)]

    def execute_model(self, sched: SchedulerOutput, non_block: bool = False):
        return self.worker.execute_model(sched, non_block)

    def sample_tokens(self, grammar) -> None:
        self.worker.sample_tokens(grammar, non_block=True)  # the step's handle is the runner's own

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig) -> Executor:
    backend = config.parallel_config.distributed_executor_backend
    if backend == "mp":
        return MultiprocExecutor(config)
    if backend == "uni":
        return UniProcExecutor(config)
    if backend == "ray":
        from pagedllm.worker.ray_executor import RayExecutor  # ray is an optional extra

        return RayExecutor(config)
    raise ValueError(f"distributed_executor_backend must be 'uni', 'mp' or 'ray', got {backend!r}")


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
            self._gather(-1, "start-up", timeout_s=envs.PAGEDLLM_WORKER_START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("Started %d worker processes (tensor_parallel_size=%d, pipeline_parallel_size=%d)",
                    self.world_size, config.parallel_config.tensor_parallel_size,
                    config.parallel_config.pipeline_parallel_size)

    # ---- calls to every worker ----------------------------------------------------------
    def _send(self, method: WorkerMethod, args: tuple = (), kwargs: dict | None = None) -> int:
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

    from pagedllm.distributed import destroy_distributed

    world_size = config.parallel_config.world_size
    if not torch.device(config.device).type == "cuda":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # the ranks share the cores
        if sys.platform == "linux":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname resolves to
    ok, worker = outcome(Worker, config, rank, init_method)
    if not ok:
        conn.send((-1, False, worker))  # the traceback
        return
    freeze_gc_heap()
    rare_full_collections()  # a process of ours that runs steps
    conn.send((-1, True, None))
    _serve(worker, conn, rank == config.parallel_config.output_rank, bool(config.scheduler_config.async_scheduling))
    destroy_distributed()


def _no_span(name: str) -> contextlib.nullcontext:
    return contextlib.nullcontext()


def _serve(worker: Worker, conn, is_output_rank: bool, overlap: bool) -> None:
    """Answer the engine's calls until told to stop or its end of the pipe closes.

    With ``overlap`` (async scheduling) a plain step is launched without waiting for its tokens,
    and is answered once they land or once the next step is launched, whichever comes first: the
    engine sends step N+1 while N runs, so the device gets N+1's kernels before this process
    blocks on N's tokens, as the engine core's own runner does in one process. Every other call
    answers the step in flight first."""
    in_flight: tuple[int, Any] | None = None  # (seq, PendingOutput) of the step launched, not answered

    def answer_in_flight() -> None:
        nonlocal in_flight
        if in_flight is not None:
            (seq, pending), in_flight = in_flight, None
            conn.send((seq, *finish_step(pending, is_output_rank)))

    while True:
        span = torch.profiler.record_function if worker.profiling else _no_span  # phases in start_profile()'s trace
        with span("worker.wait_for_engine"):
            while in_flight is not None and not conn.poll(_SPIN_S):
                if in_flight[1].ready():  # its tokens landed before the engine sent more
                    answer_in_flight()
            try:
                seq, method, args, kwargs = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break  # the engine is gone
        if overlap and method == "execute_model" and not args[0].defer_grammar:
            with span("worker.launch_step"):
                ok, pending = outcome(worker.execute_model, args[0], non_block=True)
            if not ok:
                conn.send((seq, False, pending))  # the traceback
                pending = None
            with span("worker.answer_step"):
                answer_in_flight()
            in_flight = None if pending is None else (seq, pending)
            continue
        answer_in_flight()
        if method == "shutdown":
            break
        conn.send((seq, *outcome(serve_call, worker, method, args, kwargs, is_output_rank)))
