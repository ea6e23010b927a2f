"""The package's layers, read from its source: no import cycles, core imports no Ray.

Layers (bottom to top): ``twinkle_ray.core`` (pure), ``twinkle_ray.runtime`` (Ray),
then the integrations at the package root (data, weights, serve, cli) and the
package's own ``__init__``. Every import counts, the ones inside functions too
(only ``if TYPE_CHECKING:`` blocks are skipped), so a lazy import cannot hide a cycle.
Core may import torch inside a function (``DeviceMesh.to_torch``), never at import
time: ``test_importing_core_pulls_in_neither_torch_nor_ray`` runs the imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "twinkle_ray"
FORBIDDEN_IN_CORE = ("ray",)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(modules of this package it imports, top-level names of outside packages it imports)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    inside, outside = set(), set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                (inside if alias.name.split(".")[0] == "twinkle_ray" else outside).add(
                    alias.name if alias.name.startswith("twinkle_ray") else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "twinkle_ray":
                outside.add(target.split(".")[0])
            else:
                for alias in node.names:  # `from .runtime import placement` imports a module
                    sub = f"{target}.{alias.name}"
                    inside.add(sub if sub in known else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {m for m in inside if m in known and m != name}, outside


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    known = _modules()
    edges, outside = {}, {}
    for name, path in known.items():
        edges[name], outside[name] = _imports(name, path, known)
    return edges, outside


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strongconnect(w)
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
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return found


def _layer(module: str) -> int:
    if module.startswith("twinkle_ray.core"):
        return 0
    if module.startswith("twinkle_ray.runtime"):
        return 1
    return 2  # integrations and the package root


def test_the_package_has_the_three_layers():
    names = set(_modules())
    for expected in ("twinkle_ray.core.mesh", "twinkle_ray.core.dispatch", "twinkle_ray.core.routing",
                     "twinkle_ray.runtime.dispatcher", "twinkle_ray.runtime.worker",
                     "twinkle_ray.runtime.session", "twinkle_ray.data", "twinkle_ray.weights",
                     "twinkle_ray.serve", "twinkle_ray.cli"):
        assert expected in names, expected


def test_no_import_cycles():
    edges, _ = _graph()
    assert _cycles(edges) == []


def test_core_never_imports_ray():
    _, outside = _graph()
    bad = {m: sorted(set(FORBIDDEN_IN_CORE) & pkgs) for m, pkgs in outside.items()
           if _layer(m) == 0 and set(FORBIDDEN_IN_CORE) & pkgs}
    assert bad == {}


def test_layers_import_only_downwards():
    edges, _ = _graph()
    upward = sorted((m, dep) for m, deps in edges.items() for dep in deps
                    if _layer(dep) > _layer(m))
    assert upward == []


def test_the_checker_sees_cycles_and_lazy_imports(tmp_path):
    # The checks above pass only if the parser would have caught a violation: feed it one.
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycles(edges) == [["a", "b", "c"]]
    src = tmp_path / "m.py"
    src.write_text("def f():\n    import ray\n    from ..runtime import gang\n")
    known = {"twinkle_ray.core.m": src, "twinkle_ray.runtime.gang": src}
    inside, outside = _imports("twinkle_ray.core.m", src, known)
    assert inside == {"twinkle_ray.runtime.gang"} and outside == {"ray"}


@pytest.mark.parametrize("path", ["twinkle_ray.data", "twinkle_ray.weights", "twinkle_ray.serve",
                                  "twinkle_ray.sampler", "twinkle_ray.mesh_factory"])
def test_documented_import_paths_stay(path):
    import importlib

    module = importlib.import_module(path)
    for name in getattr(module, "__all__", []):
        assert hasattr(module, name), (path, name)


def test_everything_in_all_imports():
    import twinkle_ray

    for name in twinkle_ray.__all__:
        assert getattr(twinkle_ray, name) is not None


def test_importing_core_pulls_in_neither_torch_nor_ray():
    import subprocess
    import sys

    core = [m for m in _modules() if _layer(m) == 0]
    code = (f"import sys, {', '.join(core)}; "
            "bad = [m for m in ('torch', 'ray') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(PACKAGE.parent))


# Private by convention only, and meant for callers: NamedTuple's methods; torch's
# DeviceMesh._flatten (torch 2.x's one way to name a flattened mesh dim, used by DeviceMesh.to_torch).
PUBLIC_UNDERSCORED = {"_replace", "_fields", "_asdict", "_make", "_flatten"}


def _private_reads(path: Path) -> list[str]:
    """``x._name`` on anything but ``self``/``cls`` where this module defines no ``_name``, and
    ``from .m import _name``: one module reaching into another's private attributes."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(
                node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            own.add(node.value)  # __slots__ entries, names handed to getattr
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if node.attr not in own and node.attr not in PUBLIC_UNDERSCORED:
                bad.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("twinkle_ray")):
            bad += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


def test_no_module_reads_another_modules_private_attributes():
    bad = [b for path in _modules().values() for b in _private_reads(path)]
    assert bad == [], bad


def test_the_private_attribute_check_sees_a_reach_in(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from .lazy import _hidden\n\ndef f(result):\n    return result._out\n\n"
                   "class A:\n    def __init__(self):\n        self._x = 1\n\n"
                   "    def same(self, other):\n        return other._x\n")
    assert _private_reads(src) == ["m.py:1 import _hidden", "m.py:4 ._out"]
