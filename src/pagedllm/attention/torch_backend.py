"""Reference paged attention in plain torch: runs on CPU and any device."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.kv_quant import as_bytes, dequantize, fake_quantize, is_fp8, quantize


def write_to_paged_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store each new token's K/V at its slot (``block_id * block_size + offset``); slot -1
    (padding, warm-up) is skipped. An fp8 cache stores ``saturate(x / scale)``."""
    num_kv_heads, head_dim = key.shape[-2:]
    if len(slot_mapping) and bool(slot_mapping.min() < 0):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if is_fp8(kv_cache.dtype):
        key, value = (as_bytes(quantize(x, kv_scale[i], kv_cache.dtype)) for i, x in enumerate((key, value)))
    cache = as_bytes(kv_cache)
    cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


class TorchAttentionBackend(AttentionBackend):
    """Decodes are attended in one padded batch; prefill chunks one request at a time.

    K/V of the context are read back from the paged cache through the block tables, so
    this backend checks the whole paging path, not only the math.
    """

    name = "torch"

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale, sliding_window=None,
                logits_soft_cap=None, causal=True, kv_scale=None):
        n = metadata.num_actual_tokens
        if not causal:
            return self._bidirectional(query, key, value, metadata, scale)
        fp8 = self.check_kv_scale(key, value, kv_cache, metadata, kv_scale)
        write_to_paged_cache(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n], kv_scale)
        # An fp8 cache is read as (cache dtype -> float32) x scale -> the model dtype; this step's
        # own K/V are attended as they read back (so a chunked or prefix-cached run sees the same).
        read = _CacheReader(kv_cache, kv_scale if fp8 else None, query.dtype)
        if fp8:
            key = fake_quantize(key, kv_scale[0], kv_cache.dtype)
            value = fake_quantize(value, kv_scale[1], kv_cache.dtype)
        out = torch.empty_like(query)
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        decode_reqs: list[int] = []
        for i in range(metadata.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            if end - start == 1:
                decode_reqs.append(i)
                continue
            out[start:end] = self._prefill(
                query[start:end], key[start:end], value[start:end], read,
                metadata.block_tables[i], seq_lens[i], scale, sliding_window, logits_soft_cap,
            )
        if decode_reqs:
            self._decode(query, read, metadata, decode_reqs, scale, sliding_window, logits_soft_cap, out)
        return out

    @staticmethod
    def _bidirectional(query, key, value, metadata: AttentionMetadata, scale):
        """Encoders: each sequence is whole in this step (no chunks, no cache), so its new K/V
        are its context; nothing is written to the cache. The sequences are attended in one
        padded batch (a key mask hides the padding), as one fused SDPA call."""
        qsl = metadata.query_start_loc_cpu
        lens = [qsl[i + 1] - qsl[i] for i in range(metadata.num_reqs)]
        if lens != [int(n) for n in metadata.seq_lens_cpu]:
            raise ValueError("bidirectional attention needs each sequence whole in one step")
        longest, device = max(lens), query.device
        pos = torch.arange(longest, device=device)
        starts = torch.tensor(qsl[:-1], device=device)[:, None]
        valid = pos[None, :] < torch.tensor(lens, device=device)[:, None]  # [B, L]
        index = torch.where(valid, starts + pos[None, :], starts)  # padding rows repeat the first token
        q, k, v = (t[index].transpose(1, 2) for t in (query, key, value))  # [B, H, L, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return o.transpose(1, 2)[valid]  # back to the flat rows, in order

    @staticmethod
    def _gather(read: "_CacheReader", which: int, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        cache = read.cache[which]
        num_blocks = -(-seq_len // cache.shape[1])
        return read(cache[block_table[:num_blocks]].flatten(0, 1)[:seq_len], which)

    def _prefill(self, q, k_new, v_new, read, block_table, seq_len, scale, sliding_window, soft_cap):
        q_len = q.shape[0]
        if seq_len == q_len:  # nothing cached before this chunk: the new K/V are the context
            k, v = k_new, v_new
        else:
            k = self._gather(read, 0, block_table, seq_len)
            v = self._gather(read, 1, block_table, seq_len)
        mask = None
        if seq_len != q_len or sliding_window is not None:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if soft_cap is not None:
            if mask is None:
                mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril()
            return _soft_capped_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, scale,
                                          soft_cap)[0].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q.shape[0] != k.shape[0],
        )
        return o.transpose(0, 1)

    def _decode(self, query, read, metadata, reqs, scale, sliding_window, soft_cap, out):
        """One query token per request, all requests in one padded batch.

        K and V of every request are gathered with one copy each, then one fused SDPA call
        attends over them in place (strided views; float32 accumulation for half types; on CPU
        half types are attended in float32, see below). The query heads sharing a K/V head ride
        as that head's query rows, so K/V are neither expanded nor re-read per query head.
        """
        block_size, num_kv_heads, head_dim = read.cache.shape[2:]
        # On CPU half types are attended in float32 (below), bfloat16 on AMX excepted: the additive
        # mask is made in the dtype attended.
        upcast = query.device.type == "cpu" and query.dtype != torch.float32 \
            and not (query.dtype == torch.bfloat16 and cpu_has_amx())
        tok, block_ids, valid, bias = _decode_plan(metadata, reqs, block_size, sliding_window,
                                                   torch.float32 if upcast else query.dtype)
        b = len(reqs)
        # On a 2-D [blocks, block_bytes] view index_select is one memcpy per block; on the
        # 4-D cache (or along another dim) it copies slice by slice, several times slower.
        gathered = [read(_gather_blocks(read.cache[i].flatten(1), block_ids, metadata, i), i) for i in (0, 1)]
        k, v = (x.view(b, -1, num_kv_heads, head_dim) for x in gathered)
        q = query[tok]
        if soft_cap is not None:
            o = _soft_capped_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                       valid[:, None, None, :], scale, soft_cap).squeeze(2)
        else:
            if upcast:
                # torch's CPU flash kernel in bfloat16 was ~6x slower than in float32 with one query
                # row per head (docs/cpu_performance.md); with the grouped rows below it is ~1.3x
                # slower (386 against 290 us at 32 x 128 keys) on an AVX512-BF16 EPYC, about what
                # the upcast copies cost, so there the sums stay in float32. With AMX it is faster
                # than the float32 path and its copies (a step's attention -22% on an Emerald
                # Rapids VM), and its probabilities are rounded to bfloat16 before the second
                # matmul, as transformers' own attention rounds them and as prefill chunks here do.
                q, k, v = q.float(), k.float(), v.float()
            group = q.shape[1] // num_kv_heads  # query head h reads K/V head h // group (HF's repeat_kv)
            o = F.scaled_dot_product_attention(
                q.view(b, num_kv_heads, group, head_dim), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=bias[:, None, None, :], scale=scale,
            ).reshape(b, -1, head_dim)  # [B, H, D]
        out[tok] = o.to(out.dtype)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, metadata: AttentionMetadata,
                   which: int) -> torch.Tensor:
    """The rows ``block_ids`` of the 2-D ``cache`` view. On the CPU into one buffer per K / V kept for
    the step (in ``metadata.backend_cache``; every layer's gather of a step has the same shape, and
    layers run one after another, each done with its gathered K/V before the next), so a gather
    writes memory the previous layer's already faulted in and cached instead of a fresh 2-6 MB
    allocation: ~20% off a layer's two gathers alone (SmolLM2's 32 x 8 blocks, 2-core VM)."""
    if cache.device.type != "cpu":
        return cache.index_select(0, block_ids)
    key = ("torch_decode_gather", which, cache.dtype, cache.shape[1], block_ids.numel())
    out = metadata.backend_cache.get(key)
    if out is None:
        out = metadata.backend_cache[key] = torch.empty(block_ids.numel(), cache.shape[1], dtype=cache.dtype)
    return torch.index_select(cache, 0, block_ids, out=out)


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (its bfloat16 matrix units)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def _decode_plan(metadata: AttentionMetadata, reqs: list[int], block_size: int, sliding_window: int | None,
                 dtype: torch.dtype):
    """The decode batch's token rows, the block ids its K/V gathers read and its key mask
    [B, blocks * block_size], as booleans and as ``dtype`` 0 / -inf (what SDPA turns a boolean
    mask into on every call): the same for every layer of a step. On the CPU they are made once
    per step (kept in ``metadata.backend_cache``; the runner builds each forward's metadata anew).
    Elsewhere every layer makes its own: a CUDA graph must capture them from its static inputs."""
    device = metadata.block_tables.device
    key = ("torch_decode", tuple(reqs), block_size, sliding_window, dtype) if device.type == "cpu" else None
    plan = metadata.backend_cache.get(key) if key is not None else None
    if plan is not None:
        return plan
    qsl = metadata.query_start_loc_cpu
    if reqs == list(range(reqs[0], reqs[-1] + 1)):
        tok = slice(qsl[reqs[0]], qsl[reqs[-1]] + 1)
        req_sel = slice(reqs[0], reqs[-1] + 1)
    else:
        tok = torch.tensor([qsl[i] for i in reqs], device=device)
        req_sel = torch.tensor(reqs, device=device)
    max_blocks = -(-max(metadata.seq_lens_cpu[i] for i in reqs) // block_size)
    block_ids = metadata.block_tables[req_sel, :max_blocks].reshape(-1)
    seq_lens = metadata.seq_lens[req_sel].to(torch.long)[:, None]
    k_pos = torch.arange(max_blocks * block_size, device=device)[None, :]
    valid = k_pos < seq_lens
    if sliding_window is not None:
        valid &= k_pos >= seq_lens - sliding_window
    bias = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))
    plan = (tok, block_ids, valid, bias)
    if key is not None:
        metadata.backend_cache[key] = plan
    return plan


class _CacheReader:
    """The cache as gathered (``cache``: bytes when it is fp8, torch's CPU gathers lack fp8),
    and its gathered blocks in the model dtype (dequantized: float32 x scale)."""

    def __init__(self, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.cache, self.cache_dtype, self.kv_scale, self.dtype = as_bytes(kv_cache), kv_cache.dtype, kv_scale, dtype

    def __call__(self, gathered: torch.Tensor, which: int) -> torch.Tensor:
        if self.kv_scale is None:
            return gathered
        return dequantize(gathered.view(self.cache_dtype), self.kv_scale[which], self.dtype)


def _soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                           soft_cap: float) -> torch.Tensor:
    """Attention with scores ``tanh(s / cap) * cap`` (SDPA has no soft cap), as HF's eager Gemma 2
    computes it: capped in the model dtype, masked, softmax in float32. q [B, H, Q, D], k/v
    [B, KVH, K, D], mask broadcastable to [B, H, Q, K] (True: visible)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
