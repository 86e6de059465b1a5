"""KV cache groups (vLLM's hybrid allocator): the group specs, and the manager with a full and a
sliding-window group sharing one pool (allocation, freeing outside the window, the prefix-hit
rule all groups agree on, every block back after finish / abort / preemption)."""
import itertools

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_pool import NULL_BLOCK
from pagedllm.core.kv_cache_groups import (
    KVCacheGroupSpec, blocks_per_request, layer_placement, layers_per_group, make_kv_cache_groups,
)
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

W, BS = 6, 4  # the sliding group's window, the block size


# ---- group specs -------------------------------------------------------------------------------
def test_one_spec_is_one_group_of_every_layer():
    assert make_kv_cache_groups([None] * 3) == [KVCacheGroupSpec(None, (0, 1, 2))]
    assert make_kv_cache_groups([16] * 2) == [KVCacheGroupSpec(16, (0, 1))]


def test_gemma2_alternating_layers_make_two_groups_of_half_the_layers():
    groups = make_kv_cache_groups([4096, None] * 3)  # local, global, ...
    assert groups == [KVCacheGroupSpec(None, (1, 3, 5)), KVCacheGroupSpec(4096, (0, 2, 4))]
    assert layers_per_group(groups) == 3
    assert layer_placement(groups) == {1: (0, 0), 3: (0, 1), 5: (0, 2), 0: (1, 0), 2: (1, 1), 4: (1, 2)}


def test_gemma3_five_local_to_one_global_splits_the_local_layers_into_groups_of_the_global_count():
    windows = ([512] * 5 + [None]) * 2  # 10 local, 2 global
    groups = make_kv_cache_groups(windows)
    assert [g.sliding_window for g in groups] == [None] + [512] * 5
    assert groups[0].layers == (5, 11) and groups[1].layers == (0, 1) and groups[-1].layers == (9, 10)
    assert layers_per_group(groups) == 2
    # Uneven: 7 local, 2 global -> groups of 2, the last local group holds one layer (a padding slot).
    uneven = make_kv_cache_groups([512] * 7 + [None] * 2)
    assert [len(g.layers) for g in uneven] == [2, 2, 2, 2, 1]
    # Counts within 25% of each other: one group per spec, the larger count's size.
    assert [len(g.layers) for g in make_kv_cache_groups([8] * 6 + [None] * 5)] == [5, 6]
    placement = layer_placement(uneven)
    assert sorted(placement) == list(range(9)) and len(set(placement.values())) == 9


def test_blocks_one_request_needs_count_every_group():
    full, sliding = KVCacheGroupSpec(None, (0,)), KVCacheGroupSpec(16, (1,))
    assert blocks_per_request([full], 8, 100, 32) == 13
    assert blocks_per_request([sliding], 8, 100, 32) == 13  # one group: as many as its context
    # The sliding group: the window before a step (15 tokens) and the step's 32, +1 partial block.
    assert blocks_per_request([full, sliding], 8, 100, 32) == 13 + 7
    assert blocks_per_request([full, sliding], 8, 100, 4096) == 13 + 13


# ---- the manager with two groups -------------------------------------------------------------------
_distinct = itertools.count()


def make_request(req_id: str, tokens: list[int] | None = None, n: int = 0, **params) -> Request:
    if tokens is None:
        base = 1000 * next(_distinct)
        tokens = list(range(base, base + n))
    return Request(req_id, tokens, SamplingParams(**params), eos_token_id=None, arrival_time=0.0)


def hybrid(num_blocks: int = 40, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, caching, group_windows=[None, W])


def admit(kv: KVCacheManager, req: Request) -> int:
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def decode(kv: KVCacheManager, req: Request, n: int) -> None:
    for _ in range(n):
        req.append_output_token(7)
        kv.free_outside_window(req)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


def test_every_group_gets_its_own_blocks_from_the_one_pool():
    kv = hybrid()
    req = make_request("a", n=10)
    new_blocks = kv.allocate_slots(req, 10)
    full, sliding = kv.get_block_ids("a")
    assert [len(b) for b in new_blocks] == [3, 3] and len(full) == len(sliding) == 3
    assert not set(full) & set(sliding) and kv.num_free_blocks == 40 - 6
    # A decode inside the last block: no new block in any group, the shared empty answer.
    req.num_computed_tokens = 10
    req.append_output_token(7)
    assert kv.block_ids_of(kv.allocate_slots(req, 1)) == ((), ())
    kv.free(req)
    assert kv.num_free_blocks == 40


def test_allocation_needs_room_in_every_group():
    kv = hybrid(num_blocks=5)
    assert kv.allocate_slots(make_request("a", n=12), 12) is None  # 3 blocks x 2 groups > 5
    assert not kv.req_to_blocks and kv.num_free_blocks == 5
    assert kv.allocate_slots(make_request("b", n=8), 8) is not None


def test_the_sliding_group_frees_blocks_outside_its_window_the_full_group_keeps_all():
    kv = hybrid()
    req = make_request("a", n=9)
    admit(kv, req)
    decode(kv, req, 40)  # 49 tokens: 13 blocks of context
    full, sliding = kv.req_to_blocks["a"]
    assert kv.num_held_blocks("a", 0) == 13 and NULL_BLOCK not in full
    # Position 48 sees keys 43..48: blocks 10..12 (and nothing before).
    assert kv.num_held_blocks("a", 1) <= -(-(W - 1) // BS) + 2
    assert all(b is NULL_BLOCK for b in sliding[:10]) and NULL_BLOCK not in sliding[10:]
    assert kv.num_held_blocks("a") == kv.num_held_blocks("a", 0) + kv.num_held_blocks("a", 1)
    assert kv.num_free_blocks == 40 - kv.num_held_blocks("a")
    kv.free(req)
    assert kv.num_free_blocks == 40


def test_a_prefix_hit_keeps_only_the_sliding_groups_window_and_every_full_block():
    kv = hybrid()
    a = make_request("a", n=21)
    admit(kv, a)
    b = make_request("b", tokens=list(a.all_token_ids))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 20  # 5 full blocks; one token is computed
    full_hits, sliding_hits = hits
    assert [h.block_id for h in full_hits] == kv.get_block_ids("a")[0][:5]
    # Position 20 reads keys 15..19: block 3 and 4 of the sliding group; 0..2 are not held.
    assert sliding_hits[:3] == [NULL_BLOCK] * 3
    assert [h.block_id for h in sliding_hits[3:]] == kv.get_block_ids("a")[1][3:5]
    free_before = kv.num_free_blocks
    kv.allocate_slots(b, 1, hits)
    assert kv.num_free_blocks == free_before - 2  # one new block per group; the hits were held by a
    assert kv.num_held_blocks("b", 1) == 3 and kv.num_held_blocks("b", 0) == 6
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 40


def test_the_hit_is_the_length_all_groups_agree_on():
    kv = hybrid(num_blocks=24)
    a = make_request("a", n=25)
    admit(kv, a)
    kv.free(a)  # every block free but cached: full 0..5, sliding 0..5
    full, sliding = (kv.pool.cached[g] for g in (0, 1))
    hashes = a.block_hashes
    # Evict the sliding group's block 4: a hit at 6 blocks (position 24 reads 19..23) needs it,
    # a hit at 4 blocks (reads 11..15: blocks 2, 3) does not.
    kv.pool.free_queue.move_to_end(sliding[hashes[4]].block_id, last=False)
    kv.pool.get_new_blocks(1)
    b = make_request("b", tokens=list(a.all_token_ids))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16 and [len(h) for h in hits] == [4, 4]
    assert hits[1][:2] == [NULL_BLOCK] * 2 and hits[1][2] is sliding[hashes[2]]
    # Evict the full group's block 1: the full group caps the hit at 1 block, which the sliding
    # group also holds (position 4 reads keys 0..3: its block 0).
    kv.pool.free_queue.move_to_end(full[hashes[1]].block_id, last=False)
    kv.pool.get_new_blocks(1)
    c = make_request("c", tokens=list(a.all_token_ids))
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 4 and hits == ([full[hashes[0]]], [sliding[hashes[0]]])


def test_the_pool_is_full_again_after_finished_aborted_and_preempted_requests():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=64, enable_chunked_prefill=True,
                          policy="fcfs")
    s = Scheduler(cfg, KVCacheManager(30, BS, True, group_windows=[None, W]))
    prefix = list(range(500, 512))
    for i, n in enumerate((20, 9, 31, 14, 26, 5)):
        s.add_request(make_request(f"r{i}", tokens=prefix + list(range(1000 * i, 1000 * i + n)), max_tokens=12))
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        ids = [c.req_id for c in out.scheduled_cached_reqs] + [n.req_id for n in out.scheduled_new_reqs]
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        s.update_from_output(out, ModelRunnerOutput(ids, sampled))
        steps += 1
        if steps == 6:
            s.abort_requests(["r2"])
        for req in s.running:  # block lists of both groups stay aligned
            full, sliding = s.kv.req_to_blocks[req.request_id]
            assert len(full) == len(sliding)
    assert s.num_preemptions > 0 and s.kv.stats.hits > 0
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.kv.req_to_blocks and not s.kv.num_window_freed
