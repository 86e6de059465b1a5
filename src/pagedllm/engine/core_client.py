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
from pagedllm.core.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger("pagedllm")

# Messages into the core process:
#   ("add", EngineCoreRequest) | ("abort", [request ids]) | ("utility", call_id, method, args) | ("shutdown",)
# Messages out of it:
#   ("ready", num_blocks) | ("startup_error", text, traceback) | ("outputs", EngineCoreOutputs)
#   | ("error", request_id, message) | ("utility_result", call_id, result, error_text) | ("fatal", text)

_PARENT_POLL_S = 1.0
_UTILITIES = ("get_stats", "reset_prefix_cache", "sleep", "wake_up", "is_sleeping", "collective_rpc",
              "update_weights")


class EngineDeadError(RuntimeError):
    """The engine core process stopped; no request can be served any more."""


def _exit_when_parent_dies(parent_pid: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)  # no orphans: the API process is gone, nobody will read our outputs


def _core_stats(core: Any) -> dict[str, Any]:
    kv, sched = core.kv_cache_manager, core.scheduler
    return {"num_free_blocks": kv.num_free_blocks, "num_blocks": kv.num_blocks,
            "kv_cache_usage": kv.usage, "num_running": len(sched.running), "num_waiting": len(sched.waiting)}


def run_engine_core(config: EngineConfig, input_q: Any, output_q: Any, parent_pid: int) -> None:
    """The core process's loop: drain messages, step while there is work, send outputs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it shuts us down
    threading.Thread(target=_exit_when_parent_dies, args=(parent_pid,), daemon=True).start()
    from pagedllm.engine.core import EngineCore

    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        output_q.put(("startup_error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    output_q.put(("ready", core.kv_cache_manager.num_blocks))
    try:
        while True:
            block = not core.has_unfinished_requests()
            while True:
                try:
                    msg = input_q.get(timeout=_PARENT_POLL_S) if block else input_q.get_nowait()
                except queue.Empty:
                    break
                block = False
                if msg[0] == "shutdown":
                    core.shutdown()
                    return
                _handle_message(core, msg, output_q)
            if core.has_unfinished_requests():
                out = core.step()
                if out.outputs:
                    output_q.put(("outputs", out))
    except BaseException as e:  # noqa: BLE001
        output_q.put(("fatal", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def _handle_message(core: Any, msg: tuple, output_q: Any) -> None:
    kind = msg[0]
    if kind == "add":
        request: EngineCoreRequest = msg[1]
        try:
            core.add_request(request)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
            output_q.put(("error", request.request_id, str(e)))
    elif kind == "abort":
        out = core.abort_requests(msg[1])
        if out.outputs:
            output_q.put(("outputs", out))
    elif kind == "utility":
        _, call_id, method, args = msg
        try:
            if method not in _UTILITIES:
                raise ValueError(f"unknown utility {method!r}; known: {list(_UTILITIES)}")
            result = _core_stats(core) if method == "get_stats" else getattr(core, method)(*args)
            output_q.put(("utility_result", call_id, result, None))
        except Exception as e:  # noqa: BLE001
            output_q.put(("utility_result", call_id, None, f"{type(e).__name__}: {e}"))
    else:
        logger.error("engine core: unknown message %r", kind)


class EngineCoreClient:
    """The API process's handle on the core process. Outputs (and per-request errors) are read
    by a thread and wait in a queue for `get_output`; utility calls return futures."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._input_q = ctx.Queue()
        self._output_q = ctx.Queue()
        self._outputs: queue.Queue = queue.Queue()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self.dead_reason: str | None = None
        self._closing = False
        self.process = ctx.Process(target=run_engine_core, name="pagedllm-engine-core", daemon=True,
                                   args=(config, self._input_q, self._output_q, os.getpid()))
        self.process.start()
        try:
            self.num_blocks = self._wait_ready(startup_timeout_s)
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
            if msg[0] == "ready":
                return msg[1]
            if msg[0] == "startup_error":
                logger.debug("engine core start-up failure:\n%s", msg[2])
                raise RuntimeError(f"the engine core failed to start: {msg[1]}")
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
            if msg[0] == "utility_result":
                _, call_id, result, error = msg
                with self._lock:
                    fut = self._futures.pop(call_id, None)
                if fut is not None:
                    fut.set_exception(RuntimeError(error)) if error else fut.set_result(result)
            elif msg[0] == "fatal":
                self._die(f"the engine core failed: {msg[1]}")
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
        self._outputs.put(("dead", reason))

    def _send(self, msg: tuple) -> None:
        if self._closing:
            raise EngineDeadError("the engine core was shut down")
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self._input_q.put(msg)

    # ---- the core's API ----------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(("add", request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None and not self._closing:
            self._input_q.put(("abort", list(request_ids)))

    def call_utility(self, method: str, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            call_id = next(self._call_ids)
            self._futures[call_id] = fut
        try:
            self._send(("utility", call_id, method, args))
        except EngineDeadError as e:
            with self._lock:
                self._futures.pop(call_id, None)
            fut.set_exception(e)
        return fut

    def get_output(self, timeout_s: float | None = None) -> tuple:
        """The next ("outputs", EngineCoreOutputs) | ("error", request_id, message) message, or
        ("dead", reason) / ("closed",) when the core has gone. Raises queue.Empty on timeout."""
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
                self._input_q.put(("shutdown",))
            except (ValueError, OSError):
                pass
            self.process.join(timeout_s)
        self._kill()
        self._outputs.put(("closed",))
        if getattr(self, "_reader", None) is not None:
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
