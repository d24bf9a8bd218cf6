"""The project's modules import each other without a circle, counting imports inside functions too
(a lazy import that closes a circle still couples the two modules both ways)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("megamoe", "records", "rollout", "trainer", "rl", "benchmarks")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (the longest module prefix of each)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod; `from mod import name`, mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    mods = _modules()
    assert "rollout.sync" in _imports("rl.weight_sync", mods["rl.weight_sync"], mods)


def test_no_import_circle_among_the_projects_modules():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert _cycles(graph) == []


def _imports_of(package: str, banned: set[str]) -> list[str]:
    """Every import, at any depth of any module of `package`, of a top-level name in `banned`."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in banned]
    return found


def test_megamoe_imports_neither_vllm_ray_nor_the_layers_above_it():
    """megamoe/ is the bottom layer, usable without vLLM or Ray (CONVENTIONS.md 1): no module of it
    imports them or rollout/, trainer/, rl/, even inside a function (vLLM's kernels reach it through
    megamoe.invariant.register_gpu_kernels)."""
    assert _imports_of("megamoe", {"vllm", "ray", "rollout", "trainer", "rl"}) == []


def test_records_import_no_layer_and_nothing_heavy():
    """records/ (the records rollout/, trainer/ and rl/ all import) stands alone and torch-free."""
    assert _imports_of("records", {"megamoe", "rollout", "trainer", "rl", "torch", "vllm", "ray", "transformers"}) == []


def test_trainer_imports_neither_vllm_nor_rollout():
    """No trainer process imports vLLM (its weight sync reaches the engines in the project's own records,
    records/weights.py; the engine builds vLLM's wire format) and trainer/ never imports rollout/ (layers
    meet only in rl/), even inside a function."""
    assert _imports_of("trainer", {"vllm", "rollout"}) == []
