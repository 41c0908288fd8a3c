"""The house rules of the layout, checked on the source: engine/ never imports ray or deployments, the
scheduling core (engine/core) never imports mlx nor the model layer, and no two modules of the project
import each other, directly or around a circle (function-level imports included: a lazy import that
dodges a circle is still one)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "deployments")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str) -> set[str]:
    """Every module `path` imports, at any depth of its code (absolute names; relative ones resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def project_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports (names that are not modules, e.g. classes, dropped)."""
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    return {name: {m for m in imports_of(path, name) if m in files and m != name}
            for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def external_imports(root: Path, package: str) -> dict[str, set[str]]:
    """module of `package` -> the top-level names of everything it imports."""
    out = {}
    for path in (root / package.replace(".", "/")).rglob("*.py"):
        name = module_name(path, root)
        out[name] = {m.split(".")[0] for m in imports_of(path, name)}
    return out


def test_engine_never_imports_ray_or_deployments():
    bad = {m: sorted(i & {"ray", "deployments"}) for m, i in external_imports(ROOT, "engine").items()}
    assert not {m: i for m, i in bad.items() if i}


def test_the_scheduling_core_imports_neither_mlx_nor_the_model_layer():
    bad = {m: sorted(i & {"mlx", "mlx_lm"}) for m, i in external_imports(ROOT, "engine.core").items()}
    assert not {m: i for m, i in bad.items() if i}
    graph = project_graph(ROOT)
    outside = {m: sorted(d for d in deps if not d.startswith("engine.core"))
               for m, deps in graph.items() if m.startswith("engine.core")}
    assert not {m: d for m, d in outside.items() if d}


def test_importing_the_core_loads_no_mlx():
    """At run time too: the package's public API loads what needs MLX lazily."""
    modules = sorted(m for m in project_graph(ROOT) if m.startswith("engine.core") or m == "engine.config")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'ray')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_import_circles():
    assert cycles(project_graph(ROOT)) == []


def test_the_circle_check_finds_a_circle_reintroduced(tmp_path):
    """The checker itself: a three-module circle through a function-level import is found."""
    pkg = tmp_path / "deployments"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from deployments.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from deployments.c import thing\n")
    (pkg / "c.py").write_text("thing = 1\n\ndef later():\n    from . import a\n    return a\n")
    (pkg / "d.py").write_text("import deployments.c\n")
    assert cycles(project_graph(tmp_path, ("deployments",))) == [
        ["deployments.a", "deployments.c", "deployments.sub.b"]]
