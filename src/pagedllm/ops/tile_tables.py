"""The tuned-tile tables Triton kernels ship next to them (JSON, written by the benchmarks'
``--tune`` runs): read once per process by each kernel module."""
from __future__ import annotations

import json
import os


def read_table(path: str) -> dict:
    """The table at ``path`` ({} if there is none); top-level keys starting with ``_`` are notes."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return {key: value for key, value in json.load(f).items() if not key.startswith("_")}
