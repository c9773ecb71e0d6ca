"""The layout ARCHITECTURE.md describes, kept: no import cycles, data flowing
one way (policies never simulate, the engine uses policies only through their
package's API, the library never imports the workbench)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "harmony"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, everywhere: bool = False) -> set[str]:
    """The harmony modules ``name`` imports at module level (not inside functions);
    ``everywhere``: every import, inside functions and under ``TYPE_CHECKING`` too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if everywhere else tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in MODULES and m != name}


EDGES = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges`` as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def _package(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_no_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for src, targets in EDGES.items():
        for dst in targets:
            if _package(src) != _package(dst) and _package(dst) != "harmony":
                edges.setdefault(_package(src), set()).add(_package(dst))
    assert _cycle(edges) is None


@pytest.mark.parametrize("package", sorted({_package(m) for m in MODULES if m.count(".") >= 2}))
def test_no_cycle_inside_a_package(package):
    edges = {
        m: {d for d in t if _package(d) == package}
        for m, t in EDGES.items()
        if _package(m) == package
    }
    assert _cycle(edges) is None


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_policies_build_graphs_only():
    for name, targets in EDGES.items():
        if name.startswith("harmony.policies"):
            assert not {
                t
                for t in targets
                if t.startswith(("harmony.simulate", "harmony.planner", "harmony.engine"))
            }, name


def test_the_engine_uses_policies_through_their_package_api():
    for name, targets in EDGES.items():
        if name.startswith("harmony.engine"):
            inside = {t for t in targets if t.startswith("harmony.policies.")}
            assert not inside, f"{name} imports policy internals {sorted(inside)}"


def test_the_library_never_imports_the_workbench():
    for name, targets in EDGES.items():
        if not name.startswith(("harmony.workbench", "harmony.cli")):
            assert not {t for t in targets if t.startswith("harmony.workbench")}, name


def test_engine_helpers_are_given_small_objects_not_the_engine():
    """Only the package's API imports the Engine class, counting the imports inside
    functions and under ``TYPE_CHECKING``: its helper modules are given what they
    use (a StepContext, a HostModel, a RunState, ...)."""
    for name, path in MODULES.items():
        if name.startswith("harmony.engine.") and name != "harmony.engine.engine":
            assert "harmony.engine.engine" not in _imports(name, path, everywhere=True), name


def _components(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of ``edges`` (Tarjan's algorithm): sets of
    nodes that each reach every other one of their set; a node on no cycle is one alone."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            found.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_component_finder_finds_components():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(map(sorted, _components(edges))) == [["a", "b", "c"], ["d", "e"], ["f"]]
    assert _components({"a": set()}) == [{"a"}]


def test_engine_modules_import_each_other_in_small_knots_only():
    """Counting every import (inside functions and under ``TYPE_CHECKING`` too), no
    more than three modules of the engine import each other in a circle, and the
    Engine's module is on no circle: its parts are given what they use."""
    engine = {name: path for name, path in MODULES.items() if name.startswith("harmony.engine.")}
    edges = {
        name: _imports(name, path, everywhere=True) & set(engine) for name, path in engine.items()
    }
    for component in _components(edges):
        assert len(component) <= 3, sorted(component)
        assert len(component) == 1 or "harmony.engine.engine" not in component, sorted(component)


def test_the_storage_tier_is_a_leaf():
    """``engine/tiers`` imports nothing of the rest of the engine, counting the imports
    inside functions and under ``TYPE_CHECKING``: what it shares with the engine (the
    OS's memory probes, durable renames, paced links) lives in it."""
    for name, path in MODULES.items():
        if name.startswith("harmony.engine.tiers"):
            above = {
                t
                for t in _imports(name, path, everywhere=True)
                if t.startswith("harmony.engine") and not t.startswith("harmony.engine.tiers")
            }
            assert not above, f"{name} imports {sorted(above)}"


def _reaches(edges: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = list(edges.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(edges.get(node, ()))
    return seen


def test_the_decompose_modules_are_in_no_import_cycle():
    """Counting every import (inside functions and under ``TYPE_CHECKING`` too), no
    decompose module (``decompose*``, ``hf/``) imports itself through others: what
    they share lives in ``decompose_shared``, which imports none of them."""
    everywhere = {name: _imports(name, path, everywhere=True) for name, path in MODULES.items()}
    decompose = [
        m for m in MODULES if m.startswith(("harmony.engine.decompose", "harmony.engine.hf"))
    ]
    assert "harmony.engine.decompose_shared" in decompose
    in_cycles = {
        m: sorted(c for c in _reaches(everywhere, m) if m in _reaches(everywhere, c))
        for m in decompose
    }
    assert not any(in_cycles.values()), {m: c for m, c in in_cycles.items() if c}


def test_the_cycle_reach_finds_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert _reaches(edges, "a") == {"a", "b", "c", "d"}
    assert _reaches(edges, "d") == set()


# ---- sizes -----------------------------------------------------------------------
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _oversized(text: str, where: str) -> list[str]:
    """What in module ``text`` (at ``where``) is over the limits: the module, and every
    function (nested ones too) by its lines from ``def`` to its end."""
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{where}: {lines} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name}(): {length} lines")
    return found


@pytest.mark.parametrize("group", sorted({_package(m) for m in MODULES}))
def test_modules_and_functions_stay_small(group):
    """No module over 500 lines, no function over 80 (nested ones counted on their
    own and inside the function around them)."""
    offenders = [
        o
        for name, path in sorted(MODULES.items())
        if _package(name) == group
        for o in _oversized(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert not offenders, (
        f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: "
        + "; ".join(offenders)
    )


def test_the_size_check_counts_nested_functions():
    body = "\n".join(["        x = 1"] * 79)
    assert _oversized(f"def outer():\n    def inner():\n{body}\n", "m.py") == [
        "m.py:1 outer(): 81 lines"
    ]
    body += "\n        x = 1"
    assert _oversized(f"def outer():\n    def inner():\n{body}\n", "m.py") == [
        "m.py:1 outer(): 82 lines",
        "m.py:2 inner(): 81 lines",
    ]
    assert _oversized("\n".join(["x = 1"] * 501), "m.py") == ["m.py: 501 lines"]
