"""Paged KV-cache bookkeeping: per-request block tables (one per KV cache group), prefix caching,
sliding-window freeing. The pool itself is ``core/block_pool.py``; the groups ``core/kv_cache_groups.py``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pagedllm.core.block_pool import NULL_BLOCK, BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.core.request import Request

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheManager", "PrefixCacheStats", "hash_block_tokens", "NULL_BLOCK"]

# One list of blocks per KV cache group (all of equal length: a group that does not hold a
# position has NULL_BLOCK there).
GroupBlocks = tuple[list[KVCacheBlock], ...]


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Maps each request to its physical blocks, one block table per KV cache group, and shares
    full blocks by content hash.

    ``group_windows``: each group's sliding window (None: full attention); by default one
    group of window ``sliding_window``. A group with a window W has queries that see only the
    last W keys, so a block wholly before the window of the next position computed is never
    read again by its layers: ``free_outside_window`` returns it to the pool (still
    content-hashed, so a later prompt can hit it). Full groups keep every block. All groups
    allocate from one pool and advance together: a request's lists have equal lengths."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None, group_windows: Sequence[int | None] | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = list(group_windows) if group_windows is not None else [sliding_window]
        self.num_groups = len(self.group_windows)
        # The window every layer has (one sliding group), else None.
        self.sliding_window = self.group_windows[0] if self.num_groups == 1 else None
        self._sliding_groups = [g for g, w in enumerate(self.group_windows) if w is not None]
        self.pool = BlockPool(num_blocks, enable_caching, self.num_groups)
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already hashed
        # Per sliding group, leading blocks of a request it does not hold (out of its window).
        self.num_window_freed: dict[str, list[int]] = {}
        self.stats = PrefixCacheStats()
        self._no_new_blocks: GroupBlocks = tuple([] for _ in range(self.num_groups))
        self.no_new_block_ids: tuple[tuple[int, ...], ...] = ((),) * self.num_groups

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group."""
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            return tuple([] for _ in range(self.num_groups))
        return tuple([b.block_id for b in blocks] for blocks in groups)

    def block_ids_of(self, blocks: GroupBlocks) -> tuple[list[int], ...] | tuple[tuple[int, ...], ...]:
        """``allocate_slots``' new blocks as ids, one list per group."""
        if blocks is self._no_new_blocks:
            return self.no_new_block_ids
        return tuple([b.block_id for b in group] for group in blocks)

    def _update_block_hashes(self, request: Request) -> None:
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        # Two adapters never share KV: a request with one seeds its chain with the adapter's id.
        seed = f"lora:{request.lora_int_id}".encode() if getattr(request, "lora_int_id", 0) else None
        while len(hashes) < len(tokens) // bs:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else seed, tokens[i * bs:(i + 1) * bs]))

    # ---- prefix-cache hits -------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest cached prefix every group can start from, as blocks per group, and its
        length in tokens.

        A full group needs every block of the prefix; a sliding group only the blocks of the
        last ``window - 1`` tokens before the hit point (the rest are NULL_BLOCK). The hit is
        the longest length all groups agree on (vLLM's rule). At least one token is always
        left to compute, since its logits are needed. Requests that want prompt logprobs skip
        the cache: they need every position's logits.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self._no_new_blocks, 0
        self._update_block_hashes(request)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        num_hit = len(hashes)
        settled = False
        while not settled:  # a shorter hit in one group may need re-checking in another
            settled = True
            for g in range(self.num_groups):
                n = self._longest_hit(g, hashes, num_hit)
                if n < num_hit:
                    num_hit, settled = n, self.num_groups == 1
        hits = tuple(self._hit_blocks(g, hashes, num_hit) for g in range(self.num_groups))
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit * self.block_size
        return hits, num_hit * self.block_size

    def _first_needed_block(self, g: int, num_blocks: int) -> int:
        """The first block a sliding group's query at position ``num_blocks * block_size``
        reads (it sees keys at positions > p - window); 0 for a full group."""
        window = self.group_windows[g]
        if window is None:
            return 0
        return max(num_blocks * self.block_size - window + 1, 0) // self.block_size

    def _longest_hit(self, g: int, hashes: list[bytes], max_blocks: int) -> int:
        cached = self.pool.cached[g]
        if self.group_windows[g] is None:
            n = 0
            while n < max_blocks and hashes[n] in cached:
                n += 1
            return n
        # Sliding: from the right, the first run of cached blocks long enough for its end.
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            if hashes[i] not in cached:
                run = 0
                continue
            run += 1
            if i <= self._first_needed_block(g, i + run):
                return i + run
        return 0

    def _hit_blocks(self, g: int, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock]:
        cached, first = self.pool.cached[g], self._first_needed_block(g, num_blocks)
        return [NULL_BLOCK] * first + [cached[h] for h in hashes[first:num_blocks]]

    # ---- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: GroupBlocks = (),
        num_lookahead_tokens: int = 0, reserve_blocks: int = 0,
    ) -> GroupBlocks | None:
        """Make room for ``num_new_tokens`` more tokens (and ``num_lookahead_tokens`` past them, where
        a draft model writes its guesses) in every group; returns the new blocks per group, or None
        (and no change) if out of blocks. ``new_computed_blocks``: ``get_computed_blocks``' hits.
        ``reserve_blocks``: free blocks that must remain afterwards (None if they would not)."""
        req_id = request.request_id
        groups = self.req_to_blocks.get(req_id)
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        total_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        num_held = len(groups[0]) if groups is not None else 0
        if not num_hit and total_tokens <= num_held * self.block_size and (
                not self.enable_caching or total_tokens // self.block_size <= self.num_cached_blocks.get(req_id, 0)):
            return self._no_new_blocks  # the common decode step: room left in the last block, nothing to cache
        num_required = -(-total_tokens // self.block_size)
        num_new_blocks = max(num_required - num_held - num_hit, 0)
        # Hits sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for hits in new_computed_blocks for b in hits
                                 if b.ref_cnt == 0 and b is not NULL_BLOCK)
        if num_new_blocks * self.num_groups > self.pool.num_free_blocks - num_evictable_hits - reserve_blocks:
            return None
        if groups is None:
            groups = self.req_to_blocks[req_id] = tuple([] for _ in range(self.num_groups))
            if self._sliding_groups:
                self.num_window_freed[req_id] = [0] * self.num_groups
        new_blocks = []
        for g, blocks in enumerate(groups):
            if num_hit:
                hits = new_computed_blocks[g]
                self.pool.touch(hits)
                blocks.extend(hits)
                if self.group_windows[g] is not None:  # the leading blocks it does not need
                    self.num_window_freed[req_id][g] = self._first_needed_block(g, num_hit)
            new = self.pool.get_new_blocks(num_new_blocks)
            blocks.extend(new)
            new_blocks.append(new)
        if num_hit:
            self.num_cached_blocks[req_id] = num_hit  # the hits are in the cache already
        if self.enable_caching:
            self._cache_full_blocks(request, groups, total_tokens - num_lookahead_tokens)
        return tuple(new_blocks)

    def _cache_full_blocks(self, request: Request, groups: GroupBlocks, num_tokens: int) -> None:
        """Register blocks that will be full once this step runs, so later requests can hit them.

        Safe within the same step: every layer writes all new K/V before any attention reads.
        """
        start = self.num_cached_blocks.get(request.request_id, 0)
        # Only blocks whose tokens are all known (async scheduling computes ahead of them).
        end = min(num_tokens, request.num_tokens) // self.block_size
        if end <= start:
            return
        self._update_block_hashes(request)
        hashes = request.block_hashes
        for g, blocks in enumerate(groups):
            for i in range(start, end):
                if blocks[i] is not NULL_BLOCK:
                    self.pool.cache_block(blocks[i], hashes[i], g)
        self.num_cached_blocks[request.request_id] = end

    # ---- freeing -----------------------------------------------------------------------------
    def free_outside_window(self, request: Request) -> None:
        """In each sliding group, free the request's blocks that no query from its next position
        on can attend to: a query at position p sees keys at positions > p - sliding_window."""
        if not self._sliding_groups:
            return
        groups = self.req_to_blocks.get(request.request_id)
        if groups is None:
            return
        freed = self.num_window_freed[request.request_id]
        for g in self._sliding_groups:
            blocks = groups[g]
            first_key = request.num_computed_tokens - self.group_windows[g] + 1
            n = min(max(first_key, 0) // self.block_size, len(blocks))
            start = freed[g]
            if n <= start:
                continue
            self.pool.free_blocks(reversed(blocks[start:n]))
            blocks[start:n] = [NULL_BLOCK] * (n - start)
            freed[g] = n

    def num_held_blocks(self, request_id: str, group: int | None = None) -> int:
        """Blocks the request holds now in ``group`` (None: in all groups), those freed out of
        its window not counted."""
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            return 0
        freed = self.num_window_freed.get(request_id)
        which = range(self.num_groups) if group is None else (group,)
        return sum(len(groups[g]) - (freed[g] if freed else 0) for g in which)

    def free(self, request: Request) -> None:
        """Release a request's blocks in every group; its tail is evicted before its head."""
        groups = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        freed = self.num_window_freed.pop(request.request_id, None)
        if groups is None:
            return
        for g, blocks in enumerate(groups):
            self.pool.free_blocks(reversed(blocks[freed[g] if freed else 0:]))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after a weight update); blocks in use stay valid."""
        self.pool.reset_prefix_cache()
        for req_id in self.num_cached_blocks:
            groups = self.req_to_blocks.get(req_id)
            self.num_cached_blocks[req_id] = len(groups[0]) if groups else 0
        return True
