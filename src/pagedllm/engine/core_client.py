"""EngineCoreClient: runs EngineCore in its own process and talks to it over two queues."""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.messages import (
    AbortRequests,
    AddRequest,
    CoreClosed,
    CoreDead,
    CoreFailed,
    CoreInput,
    CoreOutput,
    CoreReady,
    CoreStartupError,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestError,
    Shutdown,
    StartCore,
    UtilityCall,
    UtilityResult,
)
from pagedllm.utils import rare_full_collections

logger = logging.getLogger("pagedllm")

# The messages that cross are the dataclasses of pagedllm.core.messages: in, AddRequest |
# AbortRequests | UtilityCall | Shutdown; out, CoreReady | CoreStartupError | EngineCoreOutputs |
# RequestError | UtilityResult | CoreFailed.

_PARENT_POLL_S = 1.0
# The EngineCore methods a UtilityCall may name.
_UTILITIES = ("get_stats", "reset_prefix_cache", "sleep", "wake_up", "is_sleeping", "collective_rpc")


class EngineDeadError(RuntimeError):
    """The engine core process stopped; no request can be served any more."""


def _exit_when_parent_dies(parent_pid: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)  # no orphans: the API process is gone, nobody will read our outputs


def run_engine_core(config: EngineConfig | None, input_q: Any, output_q: Any, parent_pid: int) -> None:
    """The core process's loop: drain messages, step while there is work, send outputs. ``config``
    None: started early, the process imports the engine, then waits for a StartCore message."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it shuts us down
    threading.Thread(target=_exit_when_parent_dies, args=(parent_pid,), daemon=True).start()
    from pagedllm.engine.core import EngineCore  # torch, transformers, the engine: seconds

    if config is None:
        msg = input_q.get()
        if not isinstance(msg, StartCore):  # Shutdown: the parent gave up before it had a config
            return
        config = msg.config
    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        output_q.put(CoreStartupError(f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    rare_full_collections()  # this process only runs the engine
    output_q.put(CoreReady(core.kv_cache_manager.num_blocks))
    try:
        while True:
            block = not core.has_unfinished_requests()
            while True:
                try:
                    msg = input_q.get(timeout=_PARENT_POLL_S) if block else input_q.get_nowait()
                except queue.Empty:
                    break
                block = False
                if isinstance(msg, Shutdown):
                    core.shutdown()
                    return
                _handle_message(core, msg, output_q)
            if core.has_unfinished_requests():
                out = core.step()
                if out.outputs:
                    output_q.put(out)
    except BaseException as e:  # noqa: BLE001
        output_q.put(CoreFailed(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def _handle_message(core: Any, msg: CoreInput, output_q: Any) -> None:
    if isinstance(msg, AddRequest):
        try:
            core.add_request(msg.request)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
            output_q.put(RequestError(msg.request.request_id, str(e)))
    elif isinstance(msg, AbortRequests):
        out = core.abort_requests(msg.request_ids)
        if out.outputs:
            output_q.put(out)
    elif isinstance(msg, UtilityCall):
        try:
            if msg.method not in _UTILITIES:
                raise ValueError(f"unknown utility {msg.method!r}; known: {list(_UTILITIES)}")
            output_q.put(UtilityResult(msg.call_id, getattr(core, msg.method)(*msg.args)))
        except Exception as e:  # noqa: BLE001
            output_q.put(UtilityResult(msg.call_id, error=f"{type(e).__name__}: {e}"))
    else:
        logger.error("engine core: unknown message %r", type(msg).__name__)


class EngineCoreClient:
    """The API process's handle on the core process. Outputs (and per-request errors) are read
    by a thread and wait in a queue for `get_output`; utility calls return futures."""

    def __init__(self, config: EngineConfig | None, startup_timeout_s: float = 600.0) -> None:
        """Start the core process and wait until it is ready. With ``config`` None it starts early:
        the process imports the engine (seconds: torch, transformers) while the caller builds the
        config, which ``configure`` then sends; ``wait_ready`` waits for the core (the caller
        may load its tokenizer in between). ``shutdown`` stops it at any point."""
        ctx = multiprocessing.get_context("spawn")
        self._input_q = ctx.Queue()
        self._output_q = ctx.Queue()
        self._outputs: queue.Queue = queue.Queue()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self.dead_reason: str | None = None
        self._closing = False
        self._startup_timeout_s = startup_timeout_s
        self._reader: threading.Thread | None = None
        self.num_blocks: int | None = None
        self._configured = config is not None
        self.process = ctx.Process(target=run_engine_core, name="pagedllm-engine-core", daemon=True,
                                   args=(config, self._input_q, self._output_q, os.getpid()))
        self.process.start()
        if config is not None:
            self.wait_ready()

    def configure(self, config: EngineConfig) -> None:
        """Hand a core started without a config (``EngineCoreClient(None)``) its config, once."""
        if self._configured:
            raise RuntimeError("this engine core already has its config")
        self._configured = True
        self._send(StartCore(config))

    def wait_ready(self) -> None:
        """Wait until the core has started (RuntimeError if it failed: the process is gone then)."""
        if self._reader is not None:  # already started
            return
        try:
            self.num_blocks = self._wait_ready(self._startup_timeout_s)
        except BaseException:
            self._kill()
            raise
        self._reader = threading.Thread(target=self._read_outputs, name="pagedllm-core-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msg = self._output_q.get(timeout=0.5)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"the engine core process exited during start-up (exit code {self.process.exitcode})")
                continue
            if isinstance(msg, CoreReady):
                return msg.num_blocks
            if isinstance(msg, CoreStartupError):
                logger.debug("engine core start-up failure:\n%s", msg.traceback)
                raise RuntimeError(f"the engine core failed to start: {msg.message}")
        raise RuntimeError(f"the engine core did not start within {timeout_s:.0f} s")

    def _read_outputs(self) -> None:
        while True:
            try:
                msg = self._output_q.get(timeout=_PARENT_POLL_S)
            except queue.Empty:
                if self._closing:
                    return
                if not self.process.is_alive():
                    self._die(f"the engine core process died (exit code {self.process.exitcode})")
                    return
                continue
            except (EOFError, OSError, ValueError, AttributeError):  # closed by shutdown()
                if not self._closing:
                    self._die("the engine core's output queue closed")
                return
            if isinstance(msg, UtilityResult):
                with self._lock:
                    fut = self._futures.pop(msg.call_id, None)
                if fut is not None:
                    fut.set_exception(RuntimeError(msg.error)) if msg.error else fut.set_result(msg.result)
            elif isinstance(msg, CoreFailed):
                self._die(f"the engine core failed: {msg.message}")
                return
            else:
                self._outputs.put(msg)

    def _die(self, reason: str) -> None:
        logger.error("%s", reason)
        self.dead_reason = reason
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
        for fut in futures:
            fut.set_exception(EngineDeadError(reason))
        self._outputs.put(CoreDead(reason))

    def _send(self, msg: CoreInput) -> None:
        if self._closing:
            raise EngineDeadError("the engine core was shut down")
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self._input_q.put(msg)

    # ---- the core's API ----------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(AddRequest(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None and not self._closing:
            self._input_q.put(AbortRequests(list(request_ids)))

    def call_utility(self, method: str, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            call_id = next(self._call_ids)
            self._futures[call_id] = fut
        try:
            self._send(UtilityCall(call_id, method, args))
        except EngineDeadError as e:
            with self._lock:
                self._futures.pop(call_id, None)
            fut.set_exception(e)
        return fut

    def get_output(self, timeout_s: float | None = None) -> CoreOutput:
        """The next EngineCoreOutputs or RequestError, or CoreDead / CoreClosed when the core has
        gone. Raises queue.Empty on timeout."""
        return self._outputs.get(timeout=timeout_s)

    def is_alive(self) -> bool:
        return self.dead_reason is None and self.process.is_alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, wait for it, and kill it if it does not."""
        if self._closing:
            return
        self._closing = True
        if self.process.is_alive():
            try:
                self._input_q.put(Shutdown())
            except (ValueError, OSError):
                pass
            self.process.join(timeout_s)
        self._kill()
        self._outputs.put(CoreClosed())
        if self._reader is not None:
            self._reader.join(2 * _PARENT_POLL_S)

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        for q in (self._input_q, self._output_q):
            if q is None:
                continue
            q.close()
            if self.process.exitcode == 0:
                q.join_thread()  # the child read everything: the feeder thread ends at once
            else:
                q.cancel_join_thread()  # never hang on a queue nobody will read
        # Drop the queues now: their semaphores are released when collected, not at a
        # signal-driven exit (which would make the resource tracker warn of leaks).
        self._input_q = self._output_q = None


__all__ = ["EngineCoreClient", "EngineCoreOutputs", "EngineDeadError"]
