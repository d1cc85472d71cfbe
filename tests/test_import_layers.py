"""The package's import layers, read from the source with :mod:`ast` (nothing is imported).

* ``comm/`` (the wire format, the channels, the tied sums) sits below ``codecs/`` and ``pipeline/``: no module under
  ``lightning_clapping/comm/`` imports from ``lightning_clapping.codecs`` or ``lightning_clapping.pipeline``.
* No import cycle among the package's modules, counting the imports at module level and those inside functions,
  classes and ``if`` blocks (``TYPE_CHECKING`` included): a deferred import hides a cycle, it does not remove it.

An edge goes to the most specific module an import names: ``from lightning_clapping.codecs import fused_cpu`` to
``lightning_clapping.codecs.fused_cpu``, ``from lightning_clapping.codecs import Codec`` to the package
``lightning_clapping.codecs`` (its ``__init__``). Importing a submodule also runs its parents' ``__init__``; that
implicit edge is not counted (every submodule would otherwise close a cycle with a package that re-exports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "lightning_clapping"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
#: folder -> the package prefixes its modules must not import
FORBIDDEN = {
    f"{PACKAGE}.comm": (f"{PACKAGE}.codecs", f"{PACKAGE}.pipeline"),
}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root`` (``pkg/__init__.py`` is ``pkg``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is a module of the package (None: not the package's)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package modules ``module`` imports, anywhere in its source, with the line of the first such import."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != module:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_resolve(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: ``from . import x``, ``from ..codecs import y``
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else _resolve(base, modules), node.lineno)
    return found


def import_graph(root: Path = ROOT) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    modules = _modules(root)
    return {m: _imports(m, p, modules) for m, p in modules.items()}, modules


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # recursion depth is bounded by the package's size
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(c), c[0]) for c in components]


def _cycle_in(graph: dict[str, dict[str, int]], members: set[str], start: str) -> list[str]:
    """A shortest cycle through ``start`` inside the component ``members`` (breadth-first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def _describe(cycle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    steps = [f"{modules[a].relative_to(ROOT.parent)}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n    " + "\n    ".join(steps)


def test_comm_imports_nothing_from_codecs_or_pipeline():
    graph, modules = import_graph()
    bad = []
    for module, targets in graph.items():
        for folder, forbidden in FORBIDDEN.items():
            if module != folder and not module.startswith(folder + "."):
                continue
            for target, line in sorted(targets.items()):
                if any(target == f or target.startswith(f + ".") for f in forbidden):
                    bad.append(f"{modules[module].relative_to(ROOT.parent)}:{line} imports {target}")
    assert not bad, "comm/ sits below codecs/ and pipeline/, but:\n  " + "\n  ".join(bad)


def test_no_import_cycle_among_the_package_modules():
    graph, modules = import_graph()
    assert len(graph) > 50 and f"{PACKAGE}.comm.wire" in graph  # the walk found the package
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n  " + "\n  ".join(_describe(c, graph, modules) for c in cycles)


def test_the_checker_sees_a_cycle_through_a_function_level_import(tmp_path):
    """The checker itself: a cycle closed only by an import inside a function is found and named."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from lightning_clapping.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("import lightning_clapping.sub.a as a\n")
    graph, _ = import_graph(pkg)
    assert graph[f"{PACKAGE}.sub.b"] == {f"{PACKAGE}.sub.c": 2}
    assert find_cycles(graph) == [[f"{PACKAGE}.sub.a", f"{PACKAGE}.sub.b", f"{PACKAGE}.sub.c", f"{PACKAGE}.sub.a"]]
