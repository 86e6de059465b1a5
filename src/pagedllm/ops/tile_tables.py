"""The tuned-tile tables Triton kernels ship next to them (JSON, written by the benchmarks'
``--tune`` runs): read once per process by each kernel module."""
from __future__ import annotations

import json
import os

# The decode tables' row buckets (the small-row GEMMs: 16-bit, fp8, int4): a row count takes the next up.
# Here, beside the tables, so start-up's warm-up can read them without importing Triton.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
# The 16-bit and fp8 decode GEMMs' buckets: past 32 rows in row tiles, where the table says they win.
DECODE_ROW_BUCKETS = ROW_BUCKETS + (64, 128, 256)
DECODE_MAX_ROWS = DECODE_ROW_BUCKETS[-1]  # rows a 16-bit or fp8 small-row launch takes at most


def default_block_m(m: int) -> int:
    """The 16-bit and fp8 small-row kernels' rows per program for ``m`` rows: all of them, padded to
    16 or 32, up to 32; past that row tiles of 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


class TileTable:
    """One kernel module's table, the file ``filename`` beside the modules (or an absolute path):
    read on first use and kept; ``reload`` (after a --tune run rewrote it) reads it again on the
    next call."""

    def __init__(self, filename: str) -> None:
        self.path = os.path.join(os.path.dirname(__file__), filename)
        self._table: dict | None = None

    def __call__(self) -> dict:
        if self._table is None:
            self._table = read_table(self.path)
        return self._table

    def reload(self) -> None:
        self._table = None


def read_table(path: str) -> dict:
    """The table at ``path`` ({} if there is none); top-level keys starting with ``_`` are notes."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return {key: value for key, value in json.load(f).items() if not key.startswith("_")}


def write_table(path: str, table: dict) -> None:
    """Writes ``table`` as the tuning runs leave it (sorted keys, one entry per line) and says where."""
    with open(path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"# wrote {os.path.abspath(path)}", flush=True)


def note_tuned_on(path: str, table: dict, rows: list[int], gpu: str) -> None:
    """Records in ``table``'s ``_tuned_on`` note (kept from the file at ``path``) that ``gpu`` tuned
    ``rows``: a --tune run replaces only its row buckets, so the table's buckets may come from
    different GPUs."""
    tuned_on: dict = {}
    if os.path.isfile(path):
        with open(path) as f:
            tuned_on = json.load(f).get("_tuned_on", {})
    table["_tuned_on"] = {**tuned_on, ",".join(map(str, rows)): gpu}
