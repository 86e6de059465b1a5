"""Engines shared by the tests of one module (spawning ranks costs seconds)."""
from __future__ import annotations

import multiprocessing

import pytest

from pagedllm import LLM
from tests.engine.test_correctness import make_llm
from tests.triton_env import import_interpreted

# The peer-memory kernels: their protocol runs in Triton's interpreter without a GPU (test_lamport_all_reduce).
import_interpreted("pagedllm.distributed.triton_all_reduce")


@pytest.fixture(scope="module")
def module_llms():
    """Engines reused within a test module, shut down (and checked for leftover processes) at its end."""
    llms: dict[str, LLM] = {}
    yield llms
    for llm in llms.values():
        llm.llm_engine.engine_core.shutdown()
    assert multiprocessing.active_children() == []


def reused_llm(llms: dict, name: str, model_dir: str, **kwargs) -> LLM:
    """The module's engine called ``name``, made with ``make_llm(model_dir, **kwargs)`` on first use."""
    if name not in llms:
        llms[name] = make_llm(model_dir, **kwargs)
    return llms[name]
