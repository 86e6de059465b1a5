"""The Ray executor on a local two-node Ray cluster (CPU, gloo): ranks spread over both nodes
give TP=1's greedy outputs and logprobs; a killed actor fails the next generate promptly and
naming the rank; a placement the cluster cannot satisfy fails with a clear error, not a hang."""
from __future__ import annotations

import os
import shutil
import time
from unittest import mock

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from pagedllm import LLM  # noqa: E402
from pagedllm.worker import ray_executor  # noqa: E402
from pagedllm.worker.executor_base import WorkerFailedError  # noqa: E402
from pagedllm.worker.ray_executor import STRATEGY_ENV, RayExecutor  # noqa: E402
from tests.distributed.test_tensor_parallel import generate_with_logprobs  # noqa: E402
from tests.engine.test_correctness import _hf_model, generate_ids, make_llm, mixed_prompts  # noqa: E402

PROMPTS = mixed_prompts(4)
NODE_CPUS = (1, 1)  # one CPU per Ray node: a world size of 2 fills the cluster


def _rank_node_and_pid(worker) -> tuple[str, int]:
    """Run inside each rank's actor (collective_rpc): its Ray node and process."""
    return ray.get_runtime_context().get_node_id(), os.getpid()


@pytest.fixture(scope="module")
def ray_cluster():
    """A two-node Ray cluster on this machine; everything it started (and every actor process
    seen by the tests) is gone after it."""
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    ours = psutil.Process()
    before = {p.pid for p in ours.children(recursive=True)}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS[0]})
    for cpus in NODE_CPUS[1:]:
        cluster.add_node(num_cpus=cpus)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    actor_pids: set[int] = set()
    try:
        yield cluster, actor_pids
    finally:
        started = {p.pid for p in ours.children(recursive=True)} - before
        ray.shutdown()
        cluster.shutdown()
        assert _all_gone(started | actor_pids), "Ray processes left behind"


def _all_gone(pids: set[int], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_llms(ray_cluster):
    """Engines on the Ray cluster, reused across tests; the cluster holds one world of 2 at a time,
    so asking for another engine shuts the previous one down."""
    llms: dict[tuple, LLM] = {}
    yield llms
    for llm in llms.values():
        llm.llm_engine.engine_core.shutdown()


def ray_llm(ray_llms: dict, ray_cluster, model_dir: str, tp: int, pp: int = 1,
            strategy: str = "STRICT_SPREAD", **kwargs) -> LLM:
    key = (model_dir, tp, pp, strategy, tuple(sorted(kwargs.items())))
    if key not in ray_llms:
        for other in list(ray_llms):
            ray_llms.pop(other).llm_engine.engine_core.shutdown()
        _wait_for_free_cpus(sum(NODE_CPUS))
        with mock.patch.dict(os.environ, {STRATEGY_ENV: strategy}):
            llm = make_llm(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                           distributed_executor_backend="ray", **kwargs)
        ray_llms[key] = llm
        ray_cluster[1].update(pid for _, pid in llm.collective_rpc(_rank_node_and_pid))
    return ray_llms[key]


def _wait_for_free_cpus(n: float, timeout_s: float = 10.0) -> bool:
    """Ray returns a removed placement group's resources asynchronously."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# (tensor_parallel_size, pipeline_parallel_size): each world of 2 spread over the two nodes.
PARALLEL_SIZES = [pytest.param(2, 1, id="tp2"), pytest.param(1, 2, id="pp2")]


@pytest.mark.parametrize("tp,pp", PARALLEL_SIZES)
def test_ranks_on_two_ray_nodes_give_single_device_outputs(tiny_models, ray_cluster, ray_llms, tp, pp):
    model_dir = tiny_models["llama"]
    ref_ids, ref_lps = generate_with_logprobs(make_llm(model_dir), PROMPTS)
    # Steps in flight at once (async scheduling; with pipeline stages, one per stage), each run in
    # submission order on every actor.
    llm = ray_llm(ray_llms, ray_cluster, model_dir, tp, pp, async_scheduling=pp == 1)
    executor = llm.llm_engine.engine_core.executor
    assert isinstance(executor, RayExecutor) and len(executor.actors) == tp * pp
    # STRICT_SPREAD: one rank per Ray node, as the actors themselves report.
    nodes = [node for node, _ in llm.collective_rpc(_rank_node_and_pid)]
    assert nodes == executor.node_ids and len(set(nodes)) == tp * pp
    assert set(nodes) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    sent = []
    with mock.patch.object(executor, "_send", side_effect=lambda method, *a, **kw: sent.append(method) or
                           RayExecutor._send(executor, method, *a, **kw)):
        ids, lps = generate_with_logprobs(llm, PROMPTS)
    assert ids == ref_ids
    launches = [m for m in sent if m in (ray_executor._LAUNCH, ray_executor._COLLECT)]
    if pp == 1:  # async scheduling: step N+1 reached the actors before N's output was asked for
        assert launches.count(ray_executor._LAUNCH) == launches.count(ray_executor._COLLECT) > 2
        assert any(a == b == ray_executor._LAUNCH for a, b in zip(launches, launches[1:]))
    else:
        assert launches == []
    for got, want in zip(lps, ref_lps):  # row-parallel sums add in another order: equal up to the last bits
        assert got == pytest.approx(want, abs=1e-4)
    # A large call (full weights) goes through the object store once for every rank.
    llm.update_weights(_hf_model(model_dir).state_dict().items())
    assert generate_with_logprobs(llm, PROMPTS)[0] == ref_ids


def test_killed_actor_fails_generate_promptly_naming_the_rank(tiny_models, ray_cluster, ray_llms):
    llm = ray_llm(ray_llms, ray_cluster, tiny_models["llama"], 2, async_scheduling=True)
    assert generate_ids(llm, PROMPTS[:1])  # serving
    ray_llms.clear()  # this test ends the engine
    engine_core = llm.llm_engine.engine_core
    executor = engine_core.executor
    actors, pg = list(executor.actors), executor._state["pg"]
    ray.kill(actors[1])
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="worker rank 1 .*died during execute_model"):
        generate_ids(llm, PROMPTS)
    assert time.monotonic() - start < 10
    with pytest.raises(WorkerFailedError, match="worker rank 1"):  # and the engine stays failed, at once
        generate_ids(llm, PROMPTS)
    engine_core.shutdown()
    engine_core.shutdown()  # idempotent
    # Every actor is gone (the survivor, stuck in or past its collective, was killed too) and the
    # placement group's CPUs are back.
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.node_info.remote(), timeout=10)
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    assert _wait_for_free_cpus(sum(NODE_CPUS))


def test_worker_start_up_failure_names_the_rank(tiny_models, ray_cluster, ray_llms, tmp_path):
    for other in list(ray_llms):
        ray_llms.pop(other).llm_engine.engine_core.shutdown()
    assert _wait_for_free_cpus(sum(NODE_CPUS))
    model_dir = tmp_path / "no-weights"
    model_dir.mkdir()
    shutil.copy(os.path.join(tiny_models["llama"], "config.json"), model_dir / "config.json")
    with pytest.raises(WorkerFailedError, match=r"worker rank \d failed during start-up(.|\n)*no safetensors"):
        LLM(str(model_dir), dtype="float32", load_format="safetensors", skip_tokenizer_init=True,
            tensor_parallel_size=2, distributed_executor_backend="ray", kv_cache_memory_bytes=1 << 20)
    assert _wait_for_free_cpus(sum(NODE_CPUS))  # actors and placement group gone


@pytest.mark.parametrize("tp,strategy,match", [
    (4, "PACK", r"could not place the 4 bundles of \{'CPU': 1\}(.|\n)*2 CPU on 2 node\(s\)(.|\n)*4 needed"),
    (2, "STRICT_PACK", r"could not place the 2 bundles(.|\n)*strategy STRICT_PACK(.|\n)*on one node"),
])
def test_impossible_placement_fails_clearly(tiny_models, ray_cluster, monkeypatch, tp, strategy, match):
    monkeypatch.setenv("PAGEDLLM_WORKER_START_TIMEOUT_S", "2")
    monkeypatch.setenv(STRATEGY_ENV, strategy)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match=match):
        make_llm(tiny_models["llama"], tensor_parallel_size=tp, distributed_executor_backend="ray")
    assert time.monotonic() - start < 15
    assert not any(pg["state"] in ("PENDING", "CREATED") and pg["name"].startswith("pagedllm-")
                   for pg in ray.util.placement_group_table().values())


def test_bad_placement_strategy_is_refused(tiny_models, ray_cluster, monkeypatch):
    monkeypatch.setenv(STRATEGY_ENV, "RANDOM")
    with pytest.raises(ValueError, match=f"{STRATEGY_ENV} must be one of"):
        make_llm(tiny_models["llama"], tensor_parallel_size=2, distributed_executor_backend="ray")


def test_missing_ray_names_the_extra(monkeypatch):
    import pagedllm.worker.ray_executor as ray_executor

    monkeypatch.setattr(ray_executor, "ray", None)  # as when `import ray` failed
    with pytest.raises(ImportError, match=r'pip install "pagedllm\[ray\]"'):
        RayExecutor(None)
