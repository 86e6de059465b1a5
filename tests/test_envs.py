"""pagedllm.envs: every PAGEDLLM_* variable defined there once, read lazily, and listed in the README."""
from __future__ import annotations

import ast
import os
import re

import pytest

from pagedllm import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src", "pagedllm")


def _source_files():
    for root, _, files in os.walk(SRC):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(root, name)


def test_readme_lists_every_variable_with_the_generated_table():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert envs.markdown_table() in readme, "README's table is stale: paste `python -m pagedllm.envs` into it"
    assert set(re.findall(r"^\| `(PAGEDLLM_[A-Z0-9_]+)`", readme, re.M)) == set(envs.ENV_VARS)


def test_no_module_reads_a_pagedllm_variable_from_os_environ():
    """Reads go through envs (one definition, one default); os.environ stays for other variables."""
    bad = []
    for path in _source_files():
        if path.endswith(os.path.join("pagedllm", "envs.py")):
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"PAGEDLLM_[A-Z0-9_]+", node.value):
                if node.value not in envs.ENV_VARS:
                    bad.append(f"{path}: {node.value} is not defined in pagedllm/envs.py")
            target = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                f = node.func
                if f.attr == "getenv" or (f.attr in ("get", "pop", "setdefault")
                                          and ast.unparse(f.value).endswith("environ")):
                    target = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
                target = node.slice
            if target is not None and "PAGEDLLM_" in ast.unparse(target):
                bad.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
            if target is not None and isinstance(target, ast.Name) and target.id.endswith("ENV"):
                bad.append(f"{path}:{node.lineno}: {ast.unparse(node)} (a PAGEDLLM_* name constant?)")
    assert not bad, bad


def test_values_are_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_WORKER_START_TIMEOUT_S", raising=False)
    assert envs.PAGEDLLM_WORKER_START_TIMEOUT_S == 600.0
    monkeypatch.setenv("PAGEDLLM_WORKER_START_TIMEOUT_S", "2.5")
    assert envs.PAGEDLLM_WORKER_START_TIMEOUT_S == 2.5
    monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT_STRATEGY", " spread ")
    assert envs.PAGEDLLM_RAY_PLACEMENT_STRATEGY == "SPREAD"
    monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT_STRATEGY", "  ")  # blank: the default
    assert envs.PAGEDLLM_RAY_PLACEMENT_STRATEGY == "PACK"
    monkeypatch.setenv("PAGEDLLM_DISABLE_TRITON_OPS", "1")
    assert envs.PAGEDLLM_DISABLE_TRITON_OPS is True
    monkeypatch.setenv("PAGEDLLM_PARALLEL_COMPILE", "0")
    assert envs.PAGEDLLM_PARALLEL_COMPILE is False


def test_a_bad_value_names_the_variable_and_unknown_names_raise(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_LOG_STATS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="PAGEDLLM_LOG_STATS_INTERVAL must be a number of seconds"):
        envs.PAGEDLLM_LOG_STATS_INTERVAL
    with pytest.raises(AttributeError, match="PAGEDLLM_NOPE"):
        envs.PAGEDLLM_NOPE
    assert "PAGEDLLM_API_KEY" in dir(envs)
