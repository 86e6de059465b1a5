"""Paged KV-cache bookkeeping: block pool, per-request block tables, prefix caching."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from pagedllm.core.request import Request


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Content hash of a full block: it covers the whole prefix through the parent's hash."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix cache

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """All physical blocks, the free queue (eviction order) and the hash → block map.

    A free block may still hold a cached prefix: it is reused (and its hash dropped) only
    when no never-cached free block is left, least recently freed first.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        assert n <= len(self.free_queue), "caller must check num_free_blocks first"
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict its cached content
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; ``blocks`` in the order they should be evicted (first = first)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:  # nothing worth keeping: reuse it first
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


# Stands in a request's block list for a block freed because it fell out of the sliding window
# (the list keeps its positions). Never in the pool; its id is a valid index that no query
# reads unmasked.
_OUT_OF_WINDOW = KVCacheBlock(0)


class KVCacheManager:
    """Maps each request to its physical blocks and shares full blocks by content hash.

    ``sliding_window``: every attention layer sees only the last ``sliding_window`` keys
    (Mistral; Qwen2 with all layers sliding), so a block wholly before the window of the next
    position computed is never read again: ``free_outside_window`` returns it to the pool
    (still content-hashed, so a later prompt can hit it). Models mixing local and global layers
    (Gemma 2/3) keep every block: their global layers read them."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already hashed
        self.num_window_freed: dict[str, int] = {}  # leading blocks of a request freed (out of its window)
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def _update_block_hashes(self, request: Request) -> None:
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        # Two adapters never share KV: a request with one seeds its chain with the adapter's id.
        seed = f"lora:{request.lora_int_id}".encode() if getattr(request, "lora_int_id", 0) else None
        while len(hashes) < len(tokens) // bs:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else seed, tokens[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute, since its logits are needed.
        Requests that want prompt logprobs skip the cache: they need every position's logits.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens; None (and no change) if out of blocks."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        if not new_computed_blocks and total_tokens <= len(blocks) * self.block_size and (
                not self.enable_caching
                or total_tokens // self.block_size <= self.num_cached_blocks.get(request.request_id, 0)):
            return []  # the common decode step: room left in the last block, nothing to cache
        num_required = -(-total_tokens // self.block_size)
        num_new_blocks = max(num_required - len(blocks) - len(new_computed_blocks), 0)
        # Hits sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register blocks that will be full once this step runs, so later requests can hit them.

        Safe within the same step: every layer writes all new K/V before any attention reads.
        """
        start = self.num_cached_blocks.get(request.request_id, 0)
        # Only blocks whose tokens are all known (async scheduling computes ahead of them).
        end = min(num_tokens, request.num_tokens) // self.block_size
        if end <= start:
            return
        self._update_block_hashes(request)
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = end

    def free_outside_window(self, request: Request) -> None:
        """Free the request's blocks that no query from its next position on can attend to: a
        query at position p sees keys at positions > p - sliding_window."""
        if self.sliding_window is None:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        first_key = request.num_computed_tokens - self.sliding_window + 1
        n = min(max(first_key, 0) // self.block_size, len(blocks) if blocks else 0)
        start = self.num_window_freed.get(request.request_id, 0)
        if n <= start:
            return
        self.pool.free_blocks(reversed(blocks[start:n]))
        blocks[start:n] = [_OUT_OF_WINDOW] * (n - start)
        self.num_window_freed[request.request_id] = n

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (those freed out of its window not counted)."""
        return len(self.req_to_blocks.get(request_id, [])) - self.num_window_freed.get(request_id, 0)

    def free(self, request: Request) -> None:
        """Release a request's blocks; its tail is evicted before its head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        freed = self.num_window_freed.pop(request.request_id, 0)
        self.pool.free_blocks(reversed(blocks[freed:]))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after a weight update); blocks in use stay valid."""
        self.pool.reset_prefix_cache()
        for req_id in self.num_cached_blocks:
            self.num_cached_blocks[req_id] = len(self.req_to_blocks.get(req_id, []))
        return True
