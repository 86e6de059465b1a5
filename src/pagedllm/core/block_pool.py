"""The pool of physical KV blocks: reference counts, the free queue (eviction order), the prefix cache."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Sequence


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Content hash of a full block: it covers the whole prefix through the parent's hash."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "cache_group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix cache
        self.cache_group = 0  # the KV cache group whose layers' K/V it holds while cached

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


# Stands in a request's block list of a sliding-window group for a block it does not hold: one
# freed because it fell out of the window, or one a prefix hit did not need (the list keeps its
# positions). Never in the pool; its id is a valid index that no query reads unmasked.
NULL_BLOCK = KVCacheBlock(0)


class BlockPool:
    """All physical blocks, the free queue (eviction order) and the hash -> block maps, one per
    KV cache group (a block holds one group's layers, so the same tokens cached for two groups
    are two blocks).

    A free block may still hold a cached prefix: it is reused (and its hash dropped) only
    when no never-cached free block is left, least recently freed first.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, num_groups: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: list[dict[bytes, KVCacheBlock]] = [{} for _ in range(num_groups)]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        assert n <= len(self.free_queue), "caller must check num_free_blocks first"
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict its cached content
                cached = self.cached[block.cache_group]
                if cached.get(block.block_hash) is block:
                    del cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block is NULL_BLOCK:
                continue
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

    def cache_block(self, block: KVCacheBlock, block_hash: bytes, group: int = 0) -> None:
        cached = self.cached[group]
        if block.block_hash is None and block_hash not in cached:
            block.block_hash = block_hash
            block.cache_group = group
            cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for cached in self.cached:
            for block in cached.values():
                block.block_hash = None
            cached.clear()
