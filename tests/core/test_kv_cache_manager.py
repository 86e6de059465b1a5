"""KVCacheManager: block accounting, prefix-cache hits, LRU eviction, reset."""
import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def make_request(req_id: str, tokens: list[int], **params) -> Request:
    return Request(req_id, tokens, SamplingParams(**params), eos_token_id=None, arrival_time=0.0)


def admit(kv: KVCacheManager, req: Request) -> int:
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def test_allocates_ceil_blocks_and_frees_everything():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", list(range(10)))
    admit(kv, req)
    assert [len(ids) for ids in kv.get_block_ids("a")] == [3]  # one group
    assert kv.num_free_blocks == 7
    kv.free(req)
    assert kv.num_free_blocks == 10


def test_full_prefix_blocks_are_shared_and_last_token_is_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    b = make_request("b", list(range(12)))
    hits, num_hit = kv.get_computed_blocks(b)
    # 12 tokens = 3 full blocks, but at least one token must be computed for its logits.
    (a_ids,) = kv.get_block_ids("a")
    assert num_hit == 8 and [h.block_id for h in hits[0]] == a_ids[:2]
    kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert kv.get_block_ids("b")[0][:2] == a_ids[:2]
    assert kv.pool.blocks[a_ids[0]].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 10
    assert kv.stats.hits == 8


def test_freed_cached_blocks_are_hit_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 9])
    assert admit(kv, b) == 4  # both full blocks of a hit after a was freed
    kv.free(b)
    # A request needing every block evicts the cached ones.
    c = make_request("c", [7, 7, 7, 7, 7, 7, 7])
    assert admit(kv, c) == 0
    assert kv.num_free_blocks == 0
    kv.free(c)
    d = make_request("d", [1, 2, 3, 4, 5])
    assert admit(kv, d) == 0
    kv.free(d)


def test_allocation_fails_without_side_effects_when_out_of_blocks():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    b = make_request("b", list(range(100, 104)))
    assert kv.allocate_slots(b, 4) is None
    assert kv.get_block_ids("b") == ([],) and "b" not in kv.req_to_blocks and kv.num_free_blocks == 0
    kv.free(a)
    assert kv.num_free_blocks == 2


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    b = make_request("b", [1, 2, 3, 4, 5], prompt_logprobs=1)
    assert kv.get_computed_blocks(b) == (([],), 0)


def test_reset_prefix_cache_forgets_hashes():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert admit(kv, make_request("b", [1, 2, 3, 4, 5])) == 0


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    assert admit(kv, make_request("b", [1, 2, 3, 4, 5])) == 0


def test_block_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least 1 block"):
        KVCacheManager(num_blocks=0, block_size=16)
