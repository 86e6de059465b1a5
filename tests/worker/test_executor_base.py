"""The Executor protocol: every executor implements it, and collective_rpc checks its target
before anything reaches a worker."""
from __future__ import annotations

import pickle

import pytest

from pagedllm.core import messages
from pagedllm.worker.executor import MultiprocExecutor, UniProcExecutor
from pagedllm.worker.executor_base import Executor, WorkerGroupExecutor, check_worker_method


def test_every_executor_implements_the_one_protocol():
    assert issubclass(UniProcExecutor, Executor) and issubclass(MultiprocExecutor, WorkerGroupExecutor)
    pytest.importorskip("ray")
    from pagedllm.worker.ray_executor import RayExecutor

    assert issubclass(RayExecutor, WorkerGroupExecutor)


@pytest.mark.parametrize("method,match", [
    ("_release_device_memory", "not a public Worker method"),
    ("no_such_method", "not a public Worker method"),
    (42, "must be a str or a callable"),
])
def test_collective_rpc_refuses_what_is_not_a_public_worker_method(method, match):
    with pytest.raises(ValueError, match=match):
        check_worker_method(method)
    check_worker_method("load_weights")
    check_worker_method(lambda worker: None)


def test_core_process_messages_pickle_and_compare_by_value():
    request = messages.EngineCoreRequest("r", [1, 2], None, eos_token_id=None, arrival_time=0.0)
    for msg in (messages.AddRequest(request), messages.AbortRequests(["r"]), messages.UtilityCall(3, "sleep", (1,)),
                messages.Shutdown(), messages.CoreReady(5), messages.RequestError("r", "bad"),
                messages.UtilityResult(3, error="ValueError: x"), messages.CoreFailed("boom")):
        assert pickle.loads(pickle.dumps(msg)) == msg
