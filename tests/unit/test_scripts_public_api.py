"""The benchmark and check scripts observe the engine only through its public API and step records
(issue 20, "One house"): no script reads or writes an attribute starting with `_` of an engine object,
reaches inside it (`engine.scheduler`, `.runner`, `.executor`, `.kv`), or writes into it after
construction (variants are chosen with Engine's constructor: RunnerOptions, StepOptions). An AST scan:
an engine object is a name or attribute called `engine` or ending in `engine` (`aengine`,
`self.engine`); objects of other libraries (mlx, mlx-lm) are out of scope."""

import ast
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
INTERNALS = {"scheduler", "runner", "executor", "kv"}
WRITABLE = {"on_step"}  # AsyncEngine's step observer: the public hook, set by its caller


def _is_engine(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.endswith("engine")


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _through_engine(node: ast.AST):
    """The (engine object, its attribute) an attribute chain passes through, else None."""
    while isinstance(node, ast.Attribute):
        if _is_engine(node.value):
            return node.value, node.attr
        node = node.value
    return None


def violations(source: str, name: str = "<source>") -> list[str]:
    """Where `source` reaches inside an engine object or writes into one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and _is_engine(node.value):
            if _private(node.attr) or node.attr in INTERNALS:
                found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                hit = _through_engine(target)
                if hit is not None and not (target.value is hit[0] and target.attr in WRITABLE):
                    found.append(f"{where}: writes {ast.unparse(target)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            func, (obj, attr) = node.func.id, node.args[:2]
            attr_name = attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str) else None
            if not _is_engine(obj) or func not in ("getattr", "hasattr", "setattr", "delattr"):
                continue
            reads_inside = attr_name is not None and (_private(attr_name) or attr_name in INTERNALS)
            if reads_inside or (func in ("setattr", "delattr") and attr_name not in WRITABLE):
                found.append(f"{where}: {ast.unparse(node)}")
    return found


def test_scripts_use_the_engines_public_api_only():
    scripts = sorted(SCRIPTS.rglob("*.py"))
    assert len(scripts) >= 5
    found = [v for path in scripts for v in violations(path.read_text(), str(path.relative_to(SCRIPTS)))]
    assert not found, "scripts reach inside the engine:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "engine.scheduler.requests['a']",
    "engine.runner.decode_path",
    "x = self.engine.executor.busy",
    "engine.kv.prefix_cache.evict(1)",
    "engine._streams",
    "aengine._thread.join()",
    "engine.executor.async_decode = False",
    "engine.memory.mixed = False",
    "engine.step = traced",
    "setattr(engine, 'step', traced)",
    "getattr(engine, '_finish')",
    "getattr(engine.scheduler, 'schedule')",
])
def test_the_scan_finds_each_way_in(line):
    assert violations(line), line


@pytest.mark.parametrize("line", [
    "record = engine.step(); engine.stats().num_steps",
    "engine.execution_paths().paged_attention",
    "engine.reset_prefix_cache()",
    "aengine.on_step = observe",
    "engine.memory.kv_step",
    "mx.reset_peak_memory = reset",
    "gen._counters",
    "engine = make_engine(lm)",
])
def test_the_scan_lets_the_public_api_through(line):
    assert not violations(line), line
