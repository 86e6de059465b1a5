"""DeviceBuffers: fixed device tensors for one step's inputs, fed from pinned host staging buffers."""
from __future__ import annotations

import numpy as np
import torch


class DeviceBuffers:
    """A step costs one host-to-device copy per array, and CUDA graphs replay over the same
    addresses. On CPU the arrays are used in place (no copies at all).

    Also the pinned host buffers the sampled tokens come back to (double-buffered: step N+1
    copies into one while step N's tokens are read from the other).

    Several KV cache groups (``num_kv_groups``): group g > 0 has its own ``slot_mapping_{g}``
    and block-table buffer (``upload_block_tables(table, g)``, ``block_tables_of(g)``).
    """

    _DTYPES = {"input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
               "seq_lens": torch.int32, "query_start_loc": torch.int32, "temperature": torch.float32,
               "sample_index": torch.int64, "inflight_dst": torch.int64, "inflight_src": torch.int64}

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device,
                 num_kv_groups: int = 1) -> None:
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.num_kv_groups = num_kv_groups
        self._DTYPES = dict(self._DTYPES, **{f"slot_mapping_{g}": torch.int64 for g in range(1, num_kv_groups)})
        # Sampling rows: one per request, or with speculative decoding one per verified position.
        max_rows = max(max_tokens, max_reqs)
        sizes = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                 "seq_lens": max_reqs, "query_start_loc": max_reqs + 1, "temperature": max_rows,
                 "sample_index": max_rows, "inflight_dst": max_reqs, "inflight_src": max_reqs}
        sizes.update({f"slot_mapping_{g}": max_tokens for g in range(1, num_kv_groups)})
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        if self.on_cpu:
            return
        for name, size in sizes.items():
            self.host[name] = torch.zeros(size, dtype=self._DTYPES[name], pin_memory=True)
            self.dev[name] = torch.zeros(size, dtype=self._DTYPES[name], device=device)
        for g in range(num_kv_groups):
            name = self._table_name(g)
            self.host[name] = torch.zeros(max_reqs * max_blocks, dtype=torch.int32, pin_memory=True)
            self.dev[name] = torch.zeros(max_reqs, max_blocks, dtype=torch.int32, device=device)
        self.graph_query_start_loc = torch.arange(max_reqs + 1, dtype=torch.int32, device=device)
        # The pinned buffers are rewritten each step: wait until the last step's copies ran.
        self._copied = torch.cuda.Event()
        self._pending = False
        self._sampled_host = [torch.zeros(max_reqs, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._sampled_turn = 0

    def __getattr__(self, name: str) -> torch.Tensor:  # buf.input_ids etc.: the device tensors
        dev = self.__dict__.get("dev", {})
        if name in dev:
            return dev[name]
        raise AttributeError(name)

    def begin_step(self) -> None:
        if not self.on_cpu and self._pending:
            self._copied.synchronize()

    def end_step(self) -> None:
        if not self.on_cpu:
            self._copied.record()
            self._pending = True

    def upload(self, name: str, values: np.ndarray, size: int | None = None, pad: int = 0) -> torch.Tensor:
        """``values`` (padded with ``pad`` up to ``size``) on the device, as a view of the buffer."""
        dtype = self._DTYPES[name]
        n = len(values)
        if self.on_cpu:
            t = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
            if size is not None and size > n:
                t = torch.cat([t, torch.full((size - n,), pad, dtype=dtype)])
            return t
        size = n if size is None else size
        host = self.host[name]
        host.numpy()[:n] = values
        if size > n:
            host[n:size] = pad
        dev = self.dev[name][:size]
        dev.copy_(host[:size], non_blocking=True)
        return dev

    @staticmethod
    def _table_name(group: int) -> str:
        return "block_tables" if group == 0 else f"block_tables_{group}"

    def block_tables_of(self, group: int) -> torch.Tensor:
        """KV cache group ``group``'s device block-table buffer (``block_tables`` is group 0's)."""
        return self.dev[self._table_name(group)]

    def upload_block_tables(self, table: np.ndarray, group: int = 0) -> torch.Tensor:
        rows, cols = table.shape
        if self.on_cpu:
            return torch.from_numpy(np.ascontiguousarray(table))
        name = self._table_name(group)
        host = self.host[name][:rows * cols]
        host.numpy().reshape(rows, cols)[:] = table
        dev = self.dev[name][:rows, :cols]
        dev.copy_(host.view(rows, cols), non_blocking=True)
        return dev

    def upload_step_tables(self, tables: list[tuple[np.ndarray, np.ndarray]],
                           size: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each KV cache group's (block tables, slot mapping) of a step on the device, the slots
        padded with -1 up to ``size`` (a graph's batch)."""
        return [(self.upload_block_tables(table, g), self.upload(f"slot_mapping_{g}" if g else "slot_mapping",
                                                                   slots, size, pad=-1))
                for g, (table, slots) in enumerate(tables)]

    def sampled_tokens_host(self, n: int) -> torch.Tensor | None:
        """A pinned host buffer for ``n`` sampled tokens (the other half of the double buffer
        from the last call); None on CPU, where the sampled tensor is read directly."""
        if self.on_cpu:
            return None
        self._sampled_turn ^= 1
        return self._sampled_host[self._sampled_turn][:n]
