"""The tree stays readable: file and function sizes, no import cycle, no arrow from a lower
room to a higher one, core/ free of torch. Parsed with ``ast`` (nothing is imported), lazy
imports inside functions included; ``if TYPE_CHECKING:`` imports are left out (they never run)."""
from __future__ import annotations

import ast
import os
import sys
from functools import lru_cache

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PKG = "pagedllm"

MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
# Triton kernel files may grow past MAX_FILE_LINES (a kernel reads best whole, beside its launcher).
KERNEL_FILES = {
    "attention/triton_kernels.py",
    "ops/triton_ops.py",
    "ops/triton_gemv.py",
    "sample/triton_sampler.py",
}
# The rooms, highest first: a module may import its own room and any lower one, never a higher
# one. Keys are module-name prefixes below ``pagedllm.`` (the longest matching prefix wins).
ROOMS: dict[str, int] = {
    # 6: applications of the public API, and the package facade itself
    "": 6,  # pagedllm/__init__.py (lazy names for LLM, SamplingParams, ...)
    "benchmarks": 6,
    "integrations": 6,
    # 5: what users call
    "entrypoints": 5,
    # 4: engines, request processing, detokenizing; the tokenizer serves this room
    "engine": 4,
    "tokenizer": 4,
    # 3: scheduling (plain Python) and the device workers
    "core": 3,
    "worker": 3,
    "reasoning": 3,  # <think> parsers: the server splits replies; constraints start after the reasoning
    "spec_decode": 3,  # proposers on the host beside the scheduler (verification: sample/rejection.py)
    "structured_output": 3,  # grammars and matchers beside the scheduler; the logits bitmask
    # 2: tensor code
    "model": 2,
    "attention": 2,
    "sample": 2,
    "ops": 2,
    "distributed": 2,
    "lora": 2,  # adapters: requests, PEFT loading, slots on the linears
    "lora.manager": 3,  # the runner's adapters: device slots, host cache, its input-batch column
    # 1: the shared vocabulary every room may read (no torch here)
    "config": 1,
    "sampling_params": 1,
    "pooling_params": 1,
    "structured_params": 1,
    "outputs": 1,
    "inputs": 1,
    "utils": 1,
    "envs": 1,
    "logger": 1,
    "version": 1,
}
TORCH_LIKE = ("torch", "triton", "numpy")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


@lru_cache(maxsize=None)
def _modules() -> dict[str, str]:
    """Module name -> file path, for every .py file under src/pagedllm."""
    out = {}
    for root, _, files in os.walk(os.path.join(SRC, PKG)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                out[_module_name(path)] = path
    return out


def _rel(module: str) -> str:
    return os.path.relpath(_modules()[module], os.path.join(SRC, PKG)).replace(os.sep, "/")


@lru_cache(maxsize=None)
def _tree(module: str) -> ast.Module:
    with open(_modules()[module]) as f:
        return ast.parse(f.read(), filename=_modules()[module])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            yield from (n for o in child.orelse for n in _import_nodes_of(o))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child)


def _import_nodes_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _import_nodes(node)


@lru_cache(maxsize=None)
def _imports(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(pagedllm modules imported, top-level names of outside packages imported)."""
    mods = _modules()
    ours, theirs = set(), set()
    is_pkg = _modules()[module].endswith("__init__.py")
    for node in _import_nodes(_tree(module)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        for name in names:
            if name == PKG or name.startswith(PKG + "."):
                # The module itself, or the longest known prefix (a name imported from a module).
                while name not in mods and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name != module:
                    ours.add(name)
            else:
                theirs.add(name.split(".")[0])
    return frozenset(ours), frozenset(theirs)


def _room(module: str) -> tuple[str, int]:
    rel = module[len(PKG) + 1:] if module != PKG else ""
    best = max((k for k in ROOMS if k == "" or rel == k or rel.startswith(k + ".")), key=len)
    if best == "" and rel:
        raise AssertionError(f"{module} is in no room: add it to ROOMS in tests/test_structure.py")
    return best, ROOMS[best]


def _check_room_table() -> None:
    for module in _modules():
        _room(module)


def test_every_module_has_a_room():
    _check_room_table()


def test_files_are_short():
    too_long = []
    for module, path in _modules().items():
        rel = _rel(module)
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_FILE_LINES and rel not in KERNEL_FILES:
            too_long.append(f"{rel}: {n} lines")
    assert not too_long, f"files over {MAX_FILE_LINES} lines (split them by concern): {too_long}"


def test_kernel_allow_list_names_kernel_files():
    for rel in KERNEL_FILES:
        path = os.path.join(SRC, PKG, rel)
        assert os.path.isfile(path), f"KERNEL_FILES names a missing file: {rel}"
        with open(path) as f:
            assert "@triton.jit" in f.read(), f"KERNEL_FILES names {rel}, which holds no Triton kernel"


def _is_triton_kernel(fn: ast.AST) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit" and \
                isinstance(target.value, ast.Name) and target.value.id == "triton":
            return True
    return False


def _long_functions(module: str) -> list[str]:
    out = []
    for node in ast.walk(_tree(module)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{_rel(module)}:{node.lineno} {node.name}() {n} lines")
    return out


def test_functions_are_short():
    too_long = [f for m in _modules() for f in _long_functions(m)]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (Triton kernels excepted): {too_long}"


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted(_imports(m)[0]) for m in _modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert not _cycles(), f"import cycles (lazy imports count): {_cycles()}"


def test_no_import_from_a_lower_room_to_a_higher_one():
    bad = []
    for module in _modules():
        room, level = _room(module)
        for target in _imports(module)[0]:
            target_room, target_level = _room(target)
            if target_level > level:
                bad.append(f"{module} ({room or PKG}) imports {target} ({target_room or PKG})")
    assert not bad, "arrows from a lower room to a higher one:\n" + "\n".join(sorted(bad))


def test_core_imports_no_torch():
    """core/ is plain Python: nothing it reaches, directly or through other modules, imports torch."""
    seen: set[str] = set()
    todo = [m for m in _modules() if _room(m)[0] == "core"]
    bad = []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        ours, theirs = _imports(module)
        bad += [f"{module} imports {t}" for t in theirs if t in TORCH_LIKE]
        todo.extend(ours)
    assert not bad, bad


@pytest.mark.parametrize("source,expected", [
    ("from pagedllm.core import scheduler\n", {"pagedllm.core.scheduler"}),
    ("def f():\n    from pagedllm.engine.core import EngineCore\n", {"pagedllm.engine.core"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pagedllm.engine.core\n", set()),
])
def test_the_import_parser_sees_lazy_imports_and_skips_type_checking(source, expected, monkeypatch):
    """The checker itself: an import inside a function counts, one under TYPE_CHECKING does not."""
    module = "pagedllm.worker.worker"
    monkeypatch.setattr(sys.modules[__name__], "_tree", lambda m: ast.parse(source))
    _imports.cache_clear()
    try:
        assert set(_imports(module)[0]) == expected
    finally:
        _imports.cache_clear()


def test_data_files_ship_in_the_wheel():
    """Every non-Python file the package reads at run time (the tuned tile tables) is matched by
    pyproject's package-data, or a wheel install would run on the untuned defaults."""
    import fnmatch
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["pagedllm"]
    package = os.path.join(root, "src", "pagedllm")
    data = [os.path.relpath(os.path.join(d, name), package) for d, _, names in os.walk(package) for name in names
            if name.endswith(".json")]
    assert data, "no data files found"
    assert [path for path in data if not any(fnmatch.fnmatch(path, p) for p in patterns)] == []


def test_models_pass_attention_metadata_through_unread():
    """The piecewise CUDA graphs (worker/piecewise_graphs.py) capture everything between the
    attention calls once per padded size: a model layer that read a field of the step's attention
    metadata on the host (``attn_metadata.max_query_len``, ...) would bake the capture's value in.
    Models hand the metadata to the attention backend and read nothing but its KV-group view."""
    model_dir = os.path.join(SRC, PKG, "model")
    reads = []
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".py"):
            with open(os.path.join(model_dir, name)) as f:
                tree = ast.parse(f.read())
            reads += [f"{name}:{node.lineno} {node.value.id}.{node.attr}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id in ("attn_metadata", "metadata", "md") and node.attr != "for_group"]
    assert reads == []
