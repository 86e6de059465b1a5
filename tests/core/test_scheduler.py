"""Scheduler: token budget, chunked prefill, preemption, priorities, stop checks, aborts."""
import itertools

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams


def make_scheduler(num_blocks=100, block_size=4, max_num_seqs=8, budget=64, max_model_len=256,
                   chunked=True, policy="fcfs", caching=True) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs, budget, max_model_len, chunked, policy)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, caching))


_distinct = itertools.count()


def make_request(req_id, n_prompt, t=0.0, priority=0, eos=None, **params):
    """A request whose prompt shares no block with any other test request."""
    params.setdefault("max_tokens", 4)
    base = 1000 * next(_distinct)
    return Request(req_id, list(range(base, base + n_prompt)), SamplingParams(**params), eos, t, priority)


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    ids = [c.req_id for c in out.scheduled_cached_reqs] + [n.req_id for n in out.scheduled_new_reqs]
    sampled = [[token] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
    return out, s.update_from_output(out, ModelRunnerOutput(ids, sampled))


def test_chunked_prefill_respects_token_budget_and_mixes_with_decode():
    s = make_scheduler(budget=10)
    s.add_request(make_request("a", 4))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 4}
    s.add_request(make_request("b", 20))
    out, _ = run_step(s)
    # a decodes one token, b's prefill gets the remaining 9 of the budget.
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    out, outputs = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}
    assert {o.request_id for o in outputs if o.new_token_ids} == {"a", "b"}


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget():
    s = make_scheduler(budget=10, chunked=False)
    s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 8))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 8}


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(str(i), 4))
    out, _ = run_step(s)
    assert set(out.num_scheduled_tokens) == {"0", "1"}


def test_preemption_frees_blocks_and_request_resumes():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    s.add_request(make_request("a", 7, max_tokens=8))
    s.add_request(make_request("b", 7, max_tokens=8))
    run_step(s)  # both prefilled: 2 blocks each, cache full
    assert s.kv.num_free_blocks == 0
    run_step(s)  # the 8th token still fits in the second block
    assert s.num_preemptions == 0
    out, _ = run_step(s)  # a's 9th token needs a third block: b (latest) is preempted
    assert s.num_preemptions == 1
    assert "b" not in out.num_scheduled_tokens
    finished = set()
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        _, outputs = run_step(s)
        finished |= {o.request_id for o in outputs if o.finished}
    assert finished == {"a", "b"}
    assert s.kv.num_free_blocks == 4


@pytest.mark.parametrize("preempted_before", [False, True])
def test_a_preempted_request_comes_back_with_a_block_for_each_running_one(preempted_before):
    """In the last free block, a request is preempted as soon as the running one grows; a
    request preempted before (recomputed each time: the thrash of a full cache) waits instead
    until a block is free beyond its own for each running request."""
    s = make_scheduler(num_blocks=3, block_size=4, max_model_len=12)
    s.add_request(make_request("a", 7, max_tokens=4))
    run_step(s)  # a holds 2 blocks: 1 free
    b = make_request("b", 3, max_tokens=2)
    b.num_preemptions = int(preempted_before)
    s.add_request(b)
    out, _ = run_step(s)
    assert ("b" in out.num_scheduled_tokens) is not preempted_before
    run_step(s)  # a's 9th token needs a third block
    assert s.num_preemptions == (0 if preempted_before else 1)
    while s.has_unfinished_requests():
        run_step(s)
    assert s.kv.num_free_blocks == 3


def test_priority_policy_runs_lower_value_first_and_preempts_highest():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    s.add_request(make_request("low", 4, t=0.0, priority=5))
    s.add_request(make_request("high", 4, t=1.0, priority=-1))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["high"]


def test_stop_conditions_eos_stop_token_min_tokens_and_length():
    s = make_scheduler()
    s.add_request(make_request("eos", 4, eos=7))
    s.add_request(make_request("stop_id", 4, stop_token_ids=[7]))
    s.add_request(make_request("min", 4, eos=7, min_tokens=2, max_tokens=5))
    s.add_request(make_request("ignore", 4, max_tokens=2))
    _, outputs = run_step(s)
    by_id = {o.request_id: o for o in outputs}
    assert by_id["eos"].finish_reason == "stop" and by_id["eos"].stop_reason is None
    assert by_id["stop_id"].finish_reason == "stop" and by_id["stop_id"].stop_reason == 7
    assert by_id["min"].finish_reason is None
    _, outputs = run_step(s)
    by_id = {o.request_id: o for o in outputs}
    assert by_id["min"].finish_reason == "stop"
    assert by_id["ignore"].finish_reason == "length"
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_max_model_len_caps_generation():
    s = make_scheduler(max_model_len=6)
    s.add_request(make_request("a", 4, max_tokens=100))
    outs = []
    while s.has_unfinished_requests():
        outs += run_step(s)[1]
    assert outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 2


def test_prompt_over_max_model_len_is_refused():
    s = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len=8"):
        s.add_request(make_request("a", 8))


def test_abort_frees_blocks_of_running_and_waiting():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", 9))
    s.add_request(make_request("b", 9))
    run_step(s)
    outputs = s.abort_requests(["a", "b", "missing"])
    assert [o.finish_reason for o in outputs] == ["abort", "abort"]
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert not s.has_unfinished_requests()
    out = s.schedule()
    assert out.finished_req_ids == {"a", "b"}


def test_deferred_notices_of_an_unlaunched_step_go_out_with_the_next_one():
    """A step that ran nothing is not launched: the finished ids it carried reach the workers
    with the next step, not never (the engine core's batch queue calls defer_notices)."""
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    run_step(s)
    s.abort_requests(["a"])
    empty = s.schedule()
    assert empty.total_num_scheduled_tokens == 0 and empty.finished_req_ids == {"a"}
    s.defer_notices(empty)
    s.add_request(make_request("b", 3))
    out, _ = run_step(s)
    assert out.finished_req_ids == {"a"} and out.num_scheduled_tokens == {"b": 3}
    assert s.schedule().finished_req_ids == set()  # told once
