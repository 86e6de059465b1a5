"""The ``ray`` executor: one Ray actor per rank (tensor x pipeline), each on its own bundle of a
placement group, so the ranks may span the nodes of a Ray cluster. Same interface as
MultiprocExecutor; ray is an optional extra (``pip install "pagedllm[ray]"``)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import struct
import sys
import time
import weakref
from typing import Any

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.utils import freeze_gc_heap, rare_full_collections
from pagedllm.worker.executor_base import (
    PendingStep, WorkerFailedError, WorkerGroupExecutor, WorkerMethod, finish_step, outcome, serve_call,
)

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:  # an optional extra: the error comes when the executor is asked for
    ray = None

logger = logging.getLogger("pagedllm")

STRATEGY_ENV = "PAGEDLLM_RAY_PLACEMENT_STRATEGY"  # its name, for messages (defined in envs)
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_POLL_S = 0.5  # how often a wait wakes up to notice a dead actor or a passed deadline
# Call arguments up to this size travel inside the task (a step's SchedulerOutput: no object
# store round trip); larger ones are put in the object store once and read by every rank.
_INLINE_BYTES = 64 * 1024
_FAILURE_GRACE_S = 2.0  # after one rank fails, how long the others get to say whether they died
# The driver's settings the actors need too: Ray starts them from the raylet's environment, not ours.
# Under async scheduling a step is two calls to each actor: launch (answered at once) and collect
# (its output), so the next step's launch reaches the actor before this step's collect.
_LAUNCH, _COLLECT = "_launch_step", "_collect_step"
_ENV_PREFIXES = ("PAGEDLLM_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")


def _require_ray() -> None:
    if ray is None:
        raise ImportError('distributed_executor_backend="ray" needs Ray: pip install "pagedllm[ray]" '
                          '(or pip install ray)')


class RayExecutor(WorkerGroupExecutor):
    """Every call goes to all ranks' actors (each step's SchedulerOutput included: the scheduler
    runs once, here). Actors are synchronous (max_concurrency=1) and Ray runs one caller's
    tasks to an actor in submission order, so steps in flight run in order on every rank.
    Under async scheduling a step launched without waiting (``non_block``) is a launch call,
    which returns once the step's work is queued, and a collect call sent only when the engine
    asks for its output: the engine sends step N+1 while N runs, so N+1's launch reaches each
    actor before N's collect and the device gets N+1's kernels before the actor blocks on N's
    tokens (what the mp workers do through their pipe).
    Replies are awaited with ``ray.wait`` and a short timeout: a rank that raises or whose actor
    dies makes the call raise WorkerFailedError (naming the rank) at once, and every actor is
    killed, so no peer is left stuck in a collective."""

    def __init__(self, config: EngineConfig) -> None:
        _require_ray()
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.output_rank = pc.output_rank
        self.actors: list = []
        self.node_ids: list[str] = []  # the Ray node each rank's actor runs on
        self.node_ips: list[str] = []
        self._failure: str | None = None
        self._overlap = bool(config.scheduler_config.async_scheduling)
        self._step_seq = itertools.count()
        self._state: dict[str, Any] = {"actors": self.actors, "pg": None}
        self._finalizer = weakref.finalize(self, _stop_actors, self._state)
        start_timeout_s = envs.PAGEDLLM_WORKER_START_TIMEOUT_S
        deadline = time.monotonic() + start_timeout_s
        on_gpu = config.device.startswith("cuda")
        if on_gpu and ":" in config.device:
            # Ray picks each actor's GPU (CUDA_VISIBLE_DEVICES): an index here would name another one.
            config = dataclasses.replace(config, device="cuda")
        strategy = envs.PAGEDLLM_RAY_PLACEMENT_STRATEGY
        if strategy not in _STRATEGIES:
            raise ValueError(f"{STRATEGY_ENV} must be one of {', '.join(_STRATEGIES)}, got {strategy!r}")
        try:
            _connect(self.world_size if not on_gpu else 0)
            bundle = {"GPU": 1} if on_gpu else {"CPU": 1}
            pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=strategy,
                                 name=f"pagedllm-{os.getpid()}-{id(self):x}")
            self._state["pg"] = pg
            self._wait_for_placement(pg, bundle, strategy, start_timeout_s)
            env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
            actor_cls = ray.remote(_RayWorker)
            for rank in range(self.world_size):
                options = dict(
                    num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0, max_concurrency=1,
                    max_restarts=0, max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=rank, placement_group_capture_child_tasks=True))
                if env:
                    options["runtime_env"] = {"env_vars": env}
                self.actors.append(actor_cls.options(**options).remote())
            timeout = lambda: max(deadline - time.monotonic(), 0.0)  # noqa: E731
            nodes = self._gather([a.node_info.remote() for a in self.actors], "start-up", timeout())
            self.node_ids = [n[0] for n in nodes]
            self.node_ips = [n[1] for n in nodes]
            one_host = len(set(self.node_ips)) == 1
            master_ip = "127.0.0.1" if one_host else self.node_ips[0]
            port = self._gather([self.actors[0].free_port.remote()], "start-up", timeout(), ranks=[0])[0]
            init_method = f"tcp://{master_ip}:{port}"
            config_ref = ray.put(config)
            # Every constructor joins the process group: all ranks must start together.
            self._gather([actor.start.remote(config_ref, rank, init_method, self.node_ids.count(self.node_ids[rank]),
                                             one_host) for rank, actor in enumerate(self.actors)],
                         "start-up", timeout())
        except BaseException:
            self.shutdown()
            raise
        hosts = sorted(set(self.node_ips))
        logger.info("Started %d Ray workers (tensor_parallel_size=%d, pipeline_parallel_size=%d) on %d Ray node(s) "
                    "[%s], placement strategy %s", self.world_size, pc.tensor_parallel_size,
                    pc.pipeline_parallel_size, len(set(self.node_ids)), ", ".join(hosts), strategy)

    # ---- start-up -----------------------------------------------------------------------
    def _wait_for_placement(self, pg, bundle: dict, strategy: str, timeout_s: float) -> None:
        ready_ref, deadline = pg.ready(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ray.wait([ready_ref], timeout=min(_POLL_S, max(deadline - time.monotonic(), 0.0)))[0]:
                return
        (resource, count), = bundle.items()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per_node = [n.get("Resources", {}).get(resource, 0) for n in nodes]
        available = ray.available_resources().get(resource, 0)
        raise WorkerFailedError(
            f"Ray could not place the {self.world_size} bundles of {bundle} (one per rank, strategy {strategy}) "
            f"within {timeout_s:g} s: the cluster has {sum(per_node):g} {resource} on {len(nodes)} node(s) "
            f"(per node: {', '.join(f'{c:g}' for c in per_node) or 'none'}; {available:g} free now), "
            f"{self.world_size * count:g} needed"
            + (" on as many distinct nodes" if strategy == "STRICT_SPREAD" else
               " on one node" if strategy == "STRICT_PACK" else "")
            + f". Add resources to the Ray cluster, lower the parallel sizes, or set {STRATEGY_ENV}"
              " (PAGEDLLM_WORKER_START_TIMEOUT_S sets the wait).")

    # ---- calls to every actor -----------------------------------------------------------
    def execute_model(self, sched, non_block: bool = False):
        if not (self._overlap and non_block) or sched.defer_grammar:
            return super().execute_model(sched, non_block)
        seq = next(self._step_seq)
        launched = self._send(_LAUNCH, (seq, sched))

        def wait():
            self._gather(launched, "execute_model()")  # a rank that failed to launch is named first
            return self._gather(self._send(_COLLECT, (seq,)), "execute_model()")[self.output_rank]

        return PendingStep(wait)

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise WorkerFailedError(self._failure)

    def _send(self, method: WorkerMethod, args: tuple = (), kwargs: dict | None = None) -> list:
        self._check_alive()
        try:
            payload = ray.cloudpickle.dumps((method, args, kwargs))  # pickled once for every rank
        except Exception as e:  # noqa: BLE001 - whatever the pickler raises
            raise ValueError(f"the arguments of {getattr(method, '__name__', method)!r} cannot be sent to the "
                             f"Ray workers: {e}") from None
        if len(payload) > _INLINE_BYTES:
            payload = ray.put(payload)  # large (weights): stored once in the object store, not sent per rank
        return [actor.call.remote(payload) for actor in self.actors]

    def _gather(self, refs: list, what: str, timeout_s: float | None = None, ranks: list[int] | None = None) -> list:
        """The replies to ``refs`` (one per rank in ``ranks``, default all), in that order; raises
        WorkerFailedError if a rank raises, its actor dies, or the deadline passes."""
        self._check_alive()
        ranks = list(range(len(refs))) if ranks is None else ranks
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = dict(zip(refs, range(len(refs))))
        results: list[Any] = [None] * len(refs)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_POLL_S)
            problems = []
            for ref in ready:
                i = pending.pop(ref)
                ok, value = self._outcome(ref, ranks[i], what)
                if ok:
                    results[i] = value
                else:
                    problems.append(value)
            if problems:
                # Another rank may have died and taken this one down with it (a peer's collective
                # fails when its partner is gone): give the others a moment to say so, then name
                # the dead ones first.
                if pending:
                    more, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_FAILURE_GRACE_S)
                    for ref in more:
                        i = pending.pop(ref)
                        ok, value = self._outcome(ref, ranks[i], what)
                        if not ok:
                            problems.append(value)
                problems.sort(key=lambda p: (not p[0], p[1]))  # deaths first, then by rank
                self._fail("\n".join(p[2] for p in problems))
            if pending and deadline is not None and time.monotonic() > deadline:
                self._fail(f"worker rank(s) {sorted(ranks[i] for i in pending.values())} did not finish {what} "
                           f"within {timeout_s:.0f} s")
        return results

    def _outcome(self, ref, rank: int, what: str) -> tuple[bool, Any]:
        """(True, value), or (False, (died, rank, message))."""
        try:
            ok, value = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            node = f" on node {self.node_ips[rank]}" if rank < len(self.node_ips) else ""
            return False, (True, rank, f"worker rank {rank} (Ray actor{node}) died during {what}: "
                                       f"{_first_line(e)}")
        except ray.exceptions.RayError as e:  # the task itself could not run (arguments, memory, ...)
            return False, (False, rank, f"worker rank {rank} failed during {what}:\n{e}")
        if not ok:
            return False, (False, rank, f"worker rank {rank} failed during {what}:\n{value}")
        return True, value

    def _fail(self, message: str) -> None:
        """Remember the failure, kill every actor (no peer stuck in a collective), raise."""
        self._failure = message
        _stop_actors(self._state, graceful=False)
        raise WorkerFailedError(message)

    def shutdown(self) -> None:
        """Stop every actor (asked first, then killed) and remove the placement group; idempotent.
        Ray itself stays up (it may be the user's cluster, or serve another engine)."""
        self._finalizer()


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else type(error).__name__


def _connect(min_cpus: int) -> None:
    """Use Ray if this process is connected already; else the cluster at RAY_ADDRESS, or a local
    one that is running; else start a local one (with at least ``min_cpus`` CPUs: like the mp
    executor, more ranks than cores may share them)."""
    if ray.is_initialized():
        return
    quiet = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **quiet)
        return
    try:
        ray.init(address="auto", **quiet)  # a cluster started with `ray start` on this host
    except ConnectionError:
        num_cpus = max(os.cpu_count() or 1, min_cpus) if min_cpus else None
        ray.init(num_cpus=num_cpus, **quiet)


def _stop_actors(state: dict, graceful: bool = True, timeout_s: float = 5.0) -> None:
    actors, pg = list(state["actors"]), state["pg"]
    state["actors"].clear()
    state["pg"] = None
    if ray is None or not ray.is_initialized():
        return  # Ray is gone already (its exit hook ran first): so are the actors
    if graceful and actors:
        refs = []
        for actor in actors:
            try:
                refs.append(actor.shutdown.remote())
            except Exception:  # noqa: BLE001 - a dead actor: nothing to ask
                pass
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            except Exception:  # noqa: BLE001
                pass
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass


def _interface_with_ip(ip: str) -> str | None:
    """The name of this host's network interface that has ``ip`` (Linux), else None."""
    if sys.platform != "linux":
        return None
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


class _RayWorker:
    """The Ray actor of one rank: builds the rank's Worker, then answers the executor's calls
    with (True, result) or (False, traceback)."""

    def __init__(self) -> None:
        self.worker = None
        self.rank = -1
        self.output_rank = 0
        self.in_flight: dict[int, Any] = {}  # seq -> PendingOutput of a launched step, in launch order
        self.finished: dict[int, tuple[bool, Any]] = {}  # seq -> the reply its collect call gets

    def node_info(self) -> tuple[bool, tuple[str, str]]:
        return True, (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())

    def free_port(self) -> tuple[bool, int]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return True, s.getsockname()[1]

    def start(self, config: EngineConfig, rank: int, init_method: str, ranks_on_node: int,
              one_host: bool) -> tuple[bool, str | None]:
        self.rank, self.output_rank = rank, config.parallel_config.output_rank
        return outcome(self._start, config, rank, init_method, ranks_on_node, one_host)

    def _start(self, config: EngineConfig, rank: int, init_method: str, ranks_on_node: int, one_host: bool) -> None:
        import torch

        from pagedllm.worker.worker import Worker

        if config.device.startswith("cuda"):
            local_rank = 0  # Ray gave this actor one GPU: CUDA_VISIBLE_DEVICES names only it
        else:
            local_rank = None
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_node))  # this node's ranks share it
        if sys.platform == "linux" and "GLOO_SOCKET_IFNAME" not in os.environ:
            # One host: loopback, whatever the hostname resolves to. Several: the interface with
            # the node's Ray address (the one the peers reach), if found; else gloo's own choice.
            ifname = "lo" if one_host else _interface_with_ip(ray.util.get_node_ip_address())
            if ifname:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
        self.worker = Worker(config, rank, init_method, local_rank)
        freeze_gc_heap()
        rare_full_collections()  # a Ray actor of ours that runs steps

    def call(self, payload: tuple) -> tuple[bool, Any]:
        method, args, kwargs = ray.cloudpickle.loads(payload)
        ok, result = outcome(self._call, method, args, kwargs)
        return result if ok and method == _COLLECT else (ok, result)  # a collect returns the step's own reply

    def _call(self, method: Any, args: tuple, kwargs: dict | None) -> Any:
        if self.worker is None:
            raise RuntimeError("the worker was not started")
        if method == _COLLECT:
            return self._collect(*args)
        if method == _LAUNCH:
            seq, sched = args
            pending = self.worker.execute_model(sched, non_block=True)
            self._finish(seq)  # the steps before it end now, while this one runs
            self.in_flight[seq] = pending
            return None
        self._finish(None)  # any other call runs after the steps in flight have ended
        return serve_call(self.worker, method, args, kwargs, self.rank == self.output_rank)

    def _finish(self, before: int | None) -> None:
        """Wait for the steps in flight launched before ``before`` (all of them: None) and keep
        each one's reply for its collect call."""
        for seq in [s for s in self.in_flight if before is None or s < before]:
            self.finished[seq] = finish_step(self.in_flight.pop(seq), self.rank == self.output_rank)

    def _collect(self, seq: int) -> tuple[bool, Any]:
        self._finish(seq + 1)
        return self.finished.pop(seq)

    def shutdown(self) -> None:
        from pagedllm.distributed import destroy_distributed

        if self.worker is not None:
            self.worker = None
            destroy_distributed()
