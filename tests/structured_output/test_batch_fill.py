"""One step's masks: xgrammar's rows filled together on threads, and llguidance's on its executor,
equal each matcher's own fill; filled lazily, and filled before pickling."""
from __future__ import annotations

import pickle
import time

import numpy as np

from pagedllm.config import StructuredOutputsConfig
from pagedllm.structured_output.backends import choose_backend
from pagedllm.structured_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}}, "required": ["name", "n"]}


def test_batched_fill_equals_each_matchers_own_fill(tokenizer):
    from pagedllm.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(StructuredOutputsConfig(max_fill_threads=2), len(tokenizer), lambda: tokenizer)
    specs = [dict(json=SCHEMA), dict(regex="[a-z]{2,5}[0-9]"), dict(json=SCHEMA, whitespace_pattern=r"[ ]?"),
             dict(choice=["yes", "no"]), dict(json=SCHEMA), dict(json=SCHEMA, whitespace_pattern=r"[ ]{0,2}")]
    handles = []
    for i, spec in enumerate(specs):
        params = StructuredOutputsParams(**spec)
        params._backend = choose_backend(params, "auto")
        handles.append(manager.add_request(f"r{i}", params))
    deadline = time.monotonic() + 30
    while manager.pending and time.monotonic() < deadline:
        manager.wait(0.1)
        assert manager.poll() == []
    assert {h.params._backend for h in handles} == {"xgrammar", "guidance"}
    prefix = tokenizer.encode('{"name": "ab', add_special_tokens=False)
    for h in (handles[0], handles[4], handles[5]):  # matchers of both backends in other states than the rest
        assert h.accept_tokens(prefix)
    lazy = manager.bitmask(handles)
    assert lazy._bitmask is None  # nothing filled until read
    want = np.empty((len(handles), manager.words), dtype=np.int32)
    for row, h in enumerate(handles):
        h.fill_bitmask(want, row)
    assert np.array_equal(lazy.bitmask, want)
    sent = pickle.loads(pickle.dumps(manager.bitmask(handles)))
    assert sent.req_ids == [f"r{i}" for i in range(len(specs))] and np.array_equal(sent.bitmask, want)
    for h in handles:
        h.free()
    manager.shutdown()
